"""A mixture-of-experts MLP (Qwen3-MoE): a softmax router picks `top_k` experts per token,
each expert's products run once on all of the step's tokens routed to it, and each token
sums its experts' outputs, weighted by the router.

Batch invariance: a token's result never depends on which other tokens share its experts.
The products are row-invariant, a token's rows keep their decode/prompt kind (decode rows
come first in a step, and the grouping keeps the step's order), and each token sums its
experts in the order of their rank (not of their id or of the tokens' arrival), in float32.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.nn.functional as F

from zerohop.engine.model.linear import Linear
from zerohop.engine.model.quant import QuantizedWeight

_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")
Weight: TypeAlias = torch.Tensor | QuantizedWeight


def split_stacked_experts(tensors: Mapping[str, Weight]) -> dict[str, Weight]:
    """`tensors` with transformers 5's stacked expert parameters (`experts.gate_up_proj`
    [E, 2I, H], `experts.down_proj` [E, H, I], as a model's state dict holds them) replaced
    by the per-expert matrices checkpoints store (`experts.{e}.gate_proj.weight`, ...): views."""
    out = dict(tensors)
    for name, stacked in tensors.items():
        match = _STACKED.fullmatch(name)
        if match is None or not isinstance(stacked, torch.Tensor) or stacked.dim() != 3:
            continue
        del out[name]
        prefix, part = match.groups()
        for e, matrix in enumerate(stacked.unbind(0)):
            if part == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = matrix
                continue
            gate, up = matrix.chunk(2, dim=0)
            out[f"{prefix}.{e}.gate_proj.weight"] = gate
            out[f"{prefix}.{e}.up_proj.weight"] = up
    return out


@dataclass(slots=True, frozen=True)
class Expert:
    gate_up_proj: Linear  # gate and up stacked
    down_proj: Linear


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(slots=True)
class MoeBlock:
    router: Linear  # hidden -> one logit per expert
    experts: list[Expert]
    top_k: int
    norm_topk_prob: bool
    activation: Callable[[torch.Tensor], torch.Tensor] = silu_mul  # SiLU(gate) * up
    # The kernels' decode/prompt row split (FusedOps.set_decode_rows), where they run.
    set_decode_rows: Callable[[int], None] | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [T, k] and their float32 weights [T, k], as transformers'
        Qwen3MoeTopKRouter picks them (torch.topk: ties go to the lower expert id)."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights

    def __call__(self, x: torch.Tensor, decode_rows: int = -1) -> torch.Tensor:
        """The block's output for the step's rows `x` [T, hidden]; its first `decode_rows`
        rows are decodes (-1: all of them), as the kernels' products are told."""
        tokens, k = x.shape[0], self.top_k
        chosen, weights = self.route(x)
        # Row t * k + r of `picked` is token t's expert of rank r; a stable sort groups the
        # rows by expert with each group's tokens in step order (decodes first).
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.empty(tokens * k, x.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count == 0:
                continue
            rows = order[start : start + count]
            start += count
            token_ids = rows // k
            if self.set_decode_rows is not None and decode_rows >= 0:
                self.set_decode_rows(int((token_ids < decode_rows).sum()))
            hidden = self.activation(expert.gate_up_proj(x.index_select(0, token_ids)))
            out.index_copy_(0, rows, expert.down_proj(hidden).float())
        if self.set_decode_rows is not None:
            self.set_decode_rows(decode_rows)
        weighted = out.view(tokens, k, -1) * weights.unsqueeze(-1)
        total = weighted[:, 0]
        for rank in range(1, k):  # by rank, one add at a time: a fixed order for each token
            total = total + weighted[:, rank]
        return total.to(x.dtype).contiguous()
