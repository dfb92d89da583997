"""The batched step's grammar mask: one bitmask for the rows that carry a matcher, filled
by llguidance's executor, applied to those rows' logits before sampling (greedy and random
alike); rows without a constraint are untouched and cost nothing."""

from __future__ import annotations

import llguidance
import torch

BITS = 32


class GrammarMask:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // BITS)
        self._executor = llguidance.LLExecutor()
        self._shifts = torch.arange(BITS, dtype=torch.int32)

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, matchers: list[llguidance.LLMatcher | None]) -> None:
        """Set to -inf, in place, each constrained row's tokens its grammar does not allow
        next (EOS is allowed only where the grammar accepts)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = torch.empty((len(rows), self.words), dtype=torch.int32)
        pairs = [(matchers[i], j) for j, i in enumerate(rows)]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), self.words * 4, len(rows))
        bits = (bitmask.unsqueeze(-1) >> self._shifts) & 1
        banned = bits.view(len(rows), -1)[:, : logits.shape[-1]] == 0
        index = torch.tensor(rows, device=logits.device)
        constrained = logits.index_select(0, index)
        constrained.masked_fill_(banned.to(logits.device), float("-inf"))
        logits.index_copy_(0, index, constrained)
