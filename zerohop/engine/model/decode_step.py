"""The decode step as one C++ call (`kernels/decode_step.h`): the CPU counterpart of a
captured CUDA graph. A step whose tokens are all decodes (one new token per sequence) runs
every layer without returning to Python; anything else (prefill chunks, models with q/k
norms, weights the kernels do not hold) takes the Python fused pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from zerohop.engine.model.attention import AttentionBatch
from zerohop.engine.model.linear import Linear, kernel_product, kernel_weight

if TYPE_CHECKING:
    from zerohop.engine.model.decoder import CausalLM


class DecodeStep:
    def __init__(self, model: CausalLM, step: Any) -> None:
        self.model = model
        self.run = step  # the C++ DecodeStep (the built kernels module's: untyped)

    def supports(self, num_tokens: int, attn: AttentionBatch) -> bool:
        decode = attn.decode
        return not attn.prefills and decode is not None and decode.num_seqs == num_tokens

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBatch,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        assert attn.decode is not None
        hidden, cos, sin = self.model.kernel_inputs(input_ids, positions)
        decode = attn.decode
        return self.run(
            hidden, cos, sin, attn.slot_mapping, decode.key_slots, decode.context_lens, logits_rows
        )


def build_decode_step(
    model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
) -> DecodeStep | None:
    """The C++ step for this model and cache, or None where the Python pass must run."""
    if model.fused_ops is None or any(
        layer.q_norm is not None or layer.moe is not None for layer in model.layers
    ):
        return None
    from zerohop.engine.kernels import load

    ops = load()

    def product(linear: Linear | None) -> Any:  # the C++ Product
        weight = None if linear is None else kernel_weight(linear)
        if weight is None:
            raise LookupError
        return kernel_product(ops, weight)

    cfg = model.config
    try:
        step = ops.DecodeStep(
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
            model.scale,
            model.norm,
            product(model.lm_head),
        )
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
            step.add_layer(
                layer.input_norm,
                layer.post_norm,
                product(layer.qkv_proj),
                product(layer.o_proj),
                product(layer.gate_up_proj),
                product(layer.down_proj),
                k_cache,
                v_cache,
            )
    except LookupError:  # a product the kernels do not hold (oneDNN only, mixed types)
        return None
    return DecodeStep(model, step)
