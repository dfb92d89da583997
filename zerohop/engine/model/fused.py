"""The CPU kernels' fused operations, bound once: RMSNorm with the residual add, rotary
embedding in place, SiLU(gate) * up. `CausalLM`'s kernel forward pass (model.py) calls them,
so a decode step is ~10 kernel calls a layer instead of ~40 torch ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass(slots=True)
class FusedOps:
    rms_norm: Callable[..., torch.Tensor]  # (x, weight, eps, residual | None)
    rotate: Callable[..., None]  # (x [T, H, D], cos [T, D], sin [T, D]), in place
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    gelu_mul: Callable[[torch.Tensor], torch.Tensor]  # gelu_tanh(gate) * up (Gemma)
    # (rows): the quantized products' rows from this index on are prompt rows, which keep
    # float32 activations (decode rows round to int8); -1: every row decodes.
    set_decode_rows: Callable[[int], None]

    @classmethod
    def from_kernels(cls, module: ModuleType) -> FusedOps:
        return cls(
            module.rms_norm, module.rotate, module.silu_mul, module.gelu_mul, module.set_decode_rows
        )
