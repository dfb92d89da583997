"""The decoder's forward pass on zerohop's CPU kernels: the same math as `CausalLM.forward`,
with each layer's small operations fused (RMSNorm with the residual add, rotary embedding in
place, SiLU(gate) * up), so a decode step is ~10 kernel calls a layer instead of ~40 torch ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from zerohop.engine.attention import AttentionBatch

if TYPE_CHECKING:
    from zerohop.engine.model import CausalLM


@dataclass(slots=True)
class FusedOps:
    rms_norm: Callable[..., torch.Tensor]  # (x, weight, eps, residual | None)
    rotate: Callable[..., None]  # (x [T, H, D], cos [T, D], sin [T, D]), in place
    silu_mul: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def from_kernels(cls, module) -> FusedOps:
        return cls(module.rms_norm, module.rotate, module.silu_mul)


def kernel_inputs(
    model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the kernels take for a step: contiguous hidden states, and cos and sin [T, D]."""
    hidden = model.embed(input_ids).contiguous()
    cos = model.rotary.cos.index_select(0, positions)
    sin = model.rotary.sin.index_select(0, positions)
    return hidden, cos, sin


def fused_forward(
    model: CausalLM,
    ops: FusedOps,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attn: AttentionBatch,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    logits_rows: torch.Tensor,
) -> torch.Tensor:
    eps = model.config.rms_norm_eps
    hidden, cos, sin = kernel_inputs(model, input_ids, positions)
    layers = model.layers

    def rope(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ops.rotate(q, cos, sin)  # in place: q and k are fresh views of this layer's qkv
        ops.rotate(k, cos, sin)
        return q, k

    normed = ops.rms_norm(hidden, layers[0].input_norm, eps, None)
    for i, (layer, (k_cache, v_cache)) in enumerate(zip(layers, kv_caches, strict=True)):
        attended = model.attention(layer, normed, rope, attn, k_cache, v_cache)
        normed = ops.rms_norm(attended, layer.post_norm, eps, hidden)  # hidden += attended
        mlp = layer.down_proj(ops.silu_mul(layer.gate_up_proj(normed)))
        if i + 1 < len(layers):
            normed = ops.rms_norm(mlp, layers[i + 1].input_norm, eps, hidden)  # hidden += mlp
        else:
            hidden += mlp
    last = ops.rms_norm(hidden.index_select(0, logits_rows), model.norm, eps, None)
    return model.lm_head(last)
