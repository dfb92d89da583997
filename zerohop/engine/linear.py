"""Linear layers: oneDNN's prepacked float32 GEMM on CPU, plain `F.linear` elsewhere, and
zerohop's own kernels over block-quantized weights (`zerohop.engine.quant`).

`F.linear` on CPU re-packs the weight matrix on every call; for the small row counts of a
decode step that packing costs more than the multiply. Packing once at load time into
oneDNN's blocked layout measured 2-2.8x faster for 1-32 rows and 1.4x for 128 rows here.
The packed copy replaces the memory-mapped view, so weights stay in memory once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zerohop.engine.quant import QuantizedWeight

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True, frozen=True)
class KernelWeight:
    """A linear layer as zerohop's C++ kernels hold it, for the C++ decode step to run."""

    kind: str  # "f32" (w), "q8_0" (qs, scales) or "q4_1" (qs, scales, mins)
    tensors: tuple[torch.Tensor, ...]
    bias: torch.Tensor | None


def kernel_weight(linear: Linear) -> KernelWeight | None:
    """The weight behind a linear layer when zerohop's kernels run it, else None."""
    return getattr(linear, "kernel_weight", None)


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


def make_quantized_linear(weight: QuantizedWeight, bias: torch.Tensor | None) -> Linear:
    """x @ W.T + bias straight from the blocks (float32 x on CPU); never a dequantized copy."""
    from zerohop.engine import kernels

    ops = kernels.load()
    qs, scales, mins = weight.qs, weight.scales, weight.mins
    if weight.kind == "q8_0":
        product = lambda x: ops.q8_0_linear(x, qs, scales)  # noqa: E731
        tensors = (qs, scales)
    else:
        product = lambda x: ops.q4_1_linear(x, qs, scales, mins)  # noqa: E731
        tensors = (qs, scales, mins)
    if bias is None:
        linear = lambda x: product(x.contiguous())  # noqa: E731
    else:
        linear = lambda x: product(x.contiguous()).add_(bias)  # noqa: E731
    return _with_kernel_weight(linear, KernelWeight(weight.kind, tensors, bias))


SMALL_BATCH = 8  # rows up to which zerohop's float32 kernel beats oneDNN's (decode steps)


def make_split_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, small: Callable[..., torch.Tensor]
) -> Linear:
    """oneDNN's packed GEMM for prefill-sized inputs; for decode-sized ones, zerohop's kernel
    on the plain matrix (measured 1.1-1.7x faster at 1-4 rows, and on zerohop's own threads,
    see kernels/spin_pool.h). Keeps both copies: for a memory-mapped file, the plain one is
    the file's pages."""
    packed = make_onednn_linear(weight, bias)
    if weight.shape[1] % 32 or not weight.is_contiguous():
        return packed

    def linear(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > SMALL_BATCH:
            return packed(x)
        out = small(x.contiguous(), weight)
        return out if bias is None else out.add_(bias)

    return _with_kernel_weight(linear, KernelWeight("f32", (weight,), bias))
