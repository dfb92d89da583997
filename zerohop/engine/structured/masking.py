"""The batched step's grammar mask: one bitmask for the rows that carry a matcher, filled
by llguidance's executor, applied to those rows' logits before sampling (greedy and random
alike); rows without a constraint are untouched and cost nothing.

On the CPU the C++ kernel applies it in place (`kernels/token_mask.h`: ~0.1 ms for 32 rows
of 49k tokens, against ~10 ms for the same in torch ops); elsewhere torch does.
"""

from __future__ import annotations

import llguidance
import torch

from zerohop.engine import kernels

BITS = 32


class GrammarMask:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // BITS)
        self._executor = llguidance.LLExecutor()
        self._shifts = torch.arange(BITS, dtype=torch.int32)
        self._kernel = kernels.load().apply_token_bitmask if kernels.available() else None

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, matchers: list[llguidance.LLMatcher | None]) -> None:
        """Set to -inf, in place, each constrained row's tokens its grammar does not allow
        next (EOS is allowed only where the grammar accepts)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = torch.empty((len(rows), self.words), dtype=torch.int32)
        pairs = [(m, j) for j, i in enumerate(rows) if (m := matchers[i]) is not None]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), self.words * 4, len(rows))
        index = torch.tensor(rows, dtype=torch.long)
        if self._kernel is not None and _kernel_fits(logits):
            self._kernel(logits, bitmask, index)
        else:
            self._apply_with_torch(logits, bitmask, index.to(logits.device))

    def _apply_with_torch(
        self, logits: torch.Tensor, bitmask: torch.Tensor, index: torch.Tensor
    ) -> None:
        bits = (bitmask.unsqueeze(-1) >> self._shifts) & 1
        banned = bits.view(len(index), -1)[:, : logits.shape[-1]] == 0
        constrained = logits.index_select(0, index)
        constrained.masked_fill_(banned.to(logits.device), float("-inf"))
        logits.index_copy_(0, index, constrained)


def _kernel_fits(logits: torch.Tensor) -> bool:
    return bool(
        logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(1) == 1
    )
