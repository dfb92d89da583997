"""Linear layers. On CPU with zerohop's kernels built: their dense GEMM for float32, float16
and bfloat16 weights (packed once into its panels) and their block-quantized products
(`zerohop.engine.model.quant`). Without the kernels: oneDNN's prepacked float32 GEMM, or plain
`F.linear` elsewhere.

`F.linear` on CPU re-packs the weight matrix on every call; for the small row counts of a
decode step that packing costs more than the multiply. The packed copy replaces the
memory-mapped view, so weights stay in memory once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from zerohop.engine.model.kquant import KQuantWeight, pack_panels
from zerohop.engine.model.quant import QuantizedWeight

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True, frozen=True)
class KernelWeight:
    """A linear layer as zerohop's C++ kernels hold it, for the C++ decode step to run."""

    # "dense" (panels of W), "q8_0" (qs, scales), "q4_1" (qs, scales, mins), or where the
    # kernels have AVX-512 VNNI "q8_0_panels" / "q4_1_panels" (q8_0_pack's / q4_1_pack's);
    # K-quants "q4_k" / "q5_k" / "q6_k" (their six row-major tensors) or with VNNI
    # "q4_k_panels" etc. (kquant.pack_panels')
    kind: str
    tensors: tuple[torch.Tensor, ...]
    bias: torch.Tensor | None
    out_features: int = 0  # dense and panel kinds: N (the panels pad it to a multiple of 16)
    parts: tuple[KernelWeight, ...] = ()  # "stack": products side by side (mixed kinds)


def kernel_weight(linear: Linear) -> KernelWeight | None:
    """The weight behind a linear layer when zerohop's kernels run it, else None."""
    return getattr(linear, "kernel_weight", None)


def kernel_product(ops: Any, weight: KernelWeight) -> Any:
    """The C++ Product (kernels/decode_step.h) for `weight`."""
    if weight.kind == "stack":
        return ops.stacked_product([kernel_product(ops, part) for part in weight.parts])
    return ops.Product(weight.kind, list(weight.tensors), weight.bias, weight.out_features)


def make_side_by_side(linears: list[Linear]) -> Linear:
    """Products of different kinds that read the same input (a Q4_K_M file's Q4_K q and k
    beside its Q6_K v), their outputs side by side: one "stack" for the C++ decode step where
    the kernels hold every part."""

    def linear(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in linears], dim=-1)

    held = [kernel_weight(part) for part in linears]
    parts = tuple(weight for weight in held if weight is not None)
    if len(parts) < len(held):
        return linear
    return _with_kernel_weight(linear, KernelWeight("stack", (), None, 0, parts))


def _with_kernel_weight(linear: Linear, weight: KernelWeight) -> Linear:
    linear.kernel_weight = weight  # type: ignore[attr-defined]
    return linear


def onednn_available(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = make_onednn_linear(torch.ones(8, 4), torch.zeros(8))
        return bool(torch.allclose(probe(torch.ones(3, 4)), torch.full((3, 8), 4.0)))
    except (RuntimeError, AttributeError):
        return False


def make_onednn_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    pointwise = torch.ops.mkldnn._linear_pointwise

    def linear(x: torch.Tensor) -> torch.Tensor:
        return pointwise(x, packed, bias, "none", [], "")

    return linear


def make_plain_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    def linear(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight, bias)

    return linear


def make_quantized_linear(
    weight: QuantizedWeight, bias: torch.Tensor | None, wide: bool | None = None
) -> Linear:
    """x @ W.T + bias straight from the blocks (float32 x on CPU); never a dequantized copy.
    `wide`: the AVX-512 VNNI panels where the kernels have them (None) or not (False: the
    float path, as on CPUs without them)."""
    from zerohop.engine import kernels

    ops = kernels.load()
    if isinstance(weight, KQuantWeight):
        return _kquant_linear(ops, weight, bias, ops.wide() if wide is None else wide)
    qs, scales, mins = weight.qs, weight.scales, weight.mins
    tensors: tuple[torch.Tensor | None, ...]
    kind, out_features = weight.kind, 0
    if ops.wide():  # in panels of 16 rows, packed once (kernels/panel_product.h)
        kind, out_features = f"{weight.kind}_panels", weight.shape[0]
        if weight.kind == "q8_0":
            tensors = panels = tuple(ops.q8_0_pack(qs, scales))
            panel_linear = ops.q8_0_panel_linear
        else:
            tensors = panels = tuple(ops.q4_1_pack(qs, scales, mins))
            panel_linear = ops.q4_1_panel_linear
        product = lambda x: panel_linear(x, *panels, out_features)  # noqa: E731
    elif kind == "q8_0":
        product = lambda x: ops.q8_0_linear(x, qs, scales)  # noqa: E731
        tensors = (qs, scales)
    else:
        product = lambda x: ops.q4_1_linear(x, qs, scales, mins)  # noqa: E731
        tensors = (qs, scales, mins)
    if bias is None:
        linear = lambda x: product(x.contiguous())  # noqa: E731
    else:
        linear = lambda x: product(x.contiguous()).add_(bias)  # noqa: E731
    return _with_kernel_weight(linear, KernelWeight(kind, tensors, bias, out_features))


def _kquant_linear(ops: Any, weight: KQuantWeight, bias: torch.Tensor | None, wide: bool) -> Linear:
    kind = f"{weight.kind}_panels" if wide else weight.kind
    tensors = pack_panels(weight) if wide else weight.kernel_tensors()
    out_features = weight.shape[0]

    def linear(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = ops.kquant_linear(kind, x.contiguous(), tensors, out_features)
        return out if bias is None else out.add_(bias)

    return _with_kernel_weight(linear, KernelWeight(kind, tuple(tensors), bias, out_features))


def make_dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """make_dense_path_linear on the default path for W's dtype; ZEROHOP_BF16_DOT=0 keeps
    bfloat16 weights on the exact widening path."""
    bf16_dot = False if os.environ.get("ZEROHOP_BF16_DOT") == "0" else None
    return make_dense_path_linear(weight, bias, bf16_dot)


def make_dense_path_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, bf16_dot: bool | None
) -> Linear:
    """x @ W.T + bias on zerohop's dense kernel (kernels/dense_gemm.h), for a float32,
    float16 or bfloat16 W at any row count: W is packed once into the kernel's panels, and a
    16-bit W stays at 16 bits (widened in registers, exactly). A bfloat16 W is multiplied
    with AVX-512 BF16 instead (kernels/bf16_gemm.h: x rounded to bfloat16, ~2x faster at
    8-64 rows) where the kernels have it (`bf16_dot` None) or when told (True); False keeps
    the exact widening path, as on CPUs without the instruction."""
    from zerohop.engine import kernels

    ops = kernels.load()
    out_features = weight.shape[0]
    if bf16_dot is None:
        bf16_dot = bool(ops.bf16_dot()) and weight.shape[-1] % 2 == 0
    if weight.dtype == torch.bfloat16 and bf16_dot:
        kind, packed, product = "bf16_panels", ops.bf16_pack(weight.contiguous()), ops.bf16_linear
    else:
        kind, packed, product = "dense", ops.dense_pack(weight.contiguous()), ops.dense_linear

    def linear(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = product(x.contiguous(), packed, out_features)
        return out if bias is None else out.add_(bias)

    return _with_kernel_weight(linear, KernelWeight(kind, (packed,), bias, out_features))


@dataclass(slots=True, frozen=True)
class DensePanelRows:
    """A tied embedding read from its output layer's dense or bf16 panels (held once):
    row r is lane r % 16 of panel r // 16."""

    panels: torch.Tensor  # dense_pack's [P, K, 16] or bf16_pack's [P, K / 2, 16, 2]
    hidden: int

    @staticmethod
    def of(weight: KernelWeight | None) -> DensePanelRows | None:
        if weight is None or weight.kind not in ("dense", "bf16_panels") or weight.bias is not None:
            return None
        panels = weight.tensors[0]
        return DensePanelRows(panels, panels.shape[1] * (2 if panels.dim() == 4 else 1))

    def dequantize(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows of `input_ids`, in float32."""
        panel, lane = input_ids // 16, input_ids % 16
        if self.panels.dim() == 4:
            rows = self.panels[panel, :, lane, :]  # [T, K / 2, 2]
        else:
            rows = self.panels[panel, :, lane]  # [T, K]
        return rows.reshape(-1, self.hidden).float()
