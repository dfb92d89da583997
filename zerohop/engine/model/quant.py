"""Block-quantized weights kept compact in memory: llama.cpp's q8_0 and q4_1 layouts.

A `QuantizedWeight` is one [N, K] matrix in blocks of 32 along K, each with a float32 scale
(and, for q4_1, a float32 minimum): q8_0 w = d * q (int8 q); q4_1 w = d * q + m (q in
0..15, two per byte, element j in the low nibble and j + 16 in the high one). GGUF files'
Q8_0, Q4_0 and Q4_1 tensors map onto these without requantizing (Q4_0 is q4_1 with
m = -8 d); float weights quantize to q8_0. The product kernels are in `zerohop.engine.kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
KINDS = ("q8_0", "q4_1")


@dataclass(slots=True)
class QuantizedWeight:
    kind: str
    shape: tuple[int, int]
    qs: torch.Tensor  # q8_0: int8 [N, K]; q4_1: uint8 [N, K / 2]
    scales: torch.Tensor  # float32 [N, K / 32]
    mins: torch.Tensor | None = None  # q4_1 only, float32 [N, K / 32]

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind
        rows, cols = self.shape
        assert cols % BLOCK == 0, "K must be a multiple of the block size"
        assert tuple(self.scales.shape) == (rows, cols // BLOCK)
        assert (self.mins is not None) == (self.kind == "q4_1")

    @property
    def nbytes(self) -> int:
        parts = (self.qs, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 matrix, or only `rows` of it (the embedding lookup)."""
        qs, scales = self.qs, self.scales
        mins = self.mins
        if rows is not None:
            qs, scales = qs.index_select(0, rows), scales.index_select(0, rows)
            mins = mins.index_select(0, rows) if mins is not None else None
        count = qs.shape[0]
        if self.kind == "q8_0":
            values = qs.view(count, -1, BLOCK).float() * scales.unsqueeze(-1)
        else:
            assert mins is not None  # q4_1 blocks have mins
            packed = qs.view(count, -1, BLOCK // 2)
            nibbles = torch.cat((packed & 0x0F, packed >> 4), dim=-1).float()
            values = nibbles * scales.unsqueeze(-1) + mins.unsqueeze(-1)
        return values.reshape(count, self.shape[1])

    @staticmethod
    def concat(weights: list[QuantizedWeight]) -> QuantizedWeight:
        """The matrices stacked along N (same kind and K)."""
        return weights[0].stacked(weights)

    def stacked(self, weights: list[QuantizedWeight]) -> QuantizedWeight:
        first = self
        assert all(w.kind == first.kind and w.shape[1] == first.shape[1] for w in weights)
        rows = sum(w.shape[0] for w in weights)
        mins = None if first.mins is None else torch.cat([w.mins for w in weights])
        return QuantizedWeight(
            first.kind,
            (rows, first.shape[1]),
            torch.cat([w.qs for w in weights]),
            torch.cat([w.scales for w in weights]),
            mins,
        )

    def permute_rows(self, order: torch.Tensor) -> QuantizedWeight:
        pick = lambda t: None if t is None else t.index_select(0, order).contiguous()  # noqa: E731
        return QuantizedWeight(
            self.kind, self.shape, pick(self.qs), pick(self.scales), pick(self.mins)
        )


@dataclass(slots=True)
class PanelRows:
    """A q8_0 matrix held only as the product kernels' panels (`q8_0_pack`'s: int8 qs [P,
    blocks, 16, 32], float32 scales [P, blocks, 16]), read a row at a time: a tied embedding
    looked up from its output layer's weights instead of a second row-major copy."""

    shape: tuple[int, int]
    qs: torch.Tensor
    scales: torch.Tensor

    def dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        """The float32 rows `rows` [n] of the matrix: [n, K], as QuantizedWeight's."""
        panel, lane = rows // 16, rows % 16
        blocks = self.qs.shape[1]
        # A panel block's 32 bytes per pair of columns j are [row 0 k, row 0 k+1, row 1 k, ...].
        pairs = self.qs.view(self.qs.shape[0], blocks, 16, 16, 2)
        block, pair = torch.arange(blocks)[None, :, None], torch.arange(16)[None, None, :]
        values = pairs[panel[:, None, None], block, pair, lane[:, None, None]]
        scales = self.scales[panel[:, None], torch.arange(blocks)[None, :], lane[:, None]]
        count = rows.shape[0]
        return (values.reshape(count, blocks, BLOCK).float() * scales.unsqueeze(-1)).reshape(
            count, self.shape[1]
        )


def quantize_q8_0(weight: torch.Tensor) -> QuantizedWeight:
    """Float [N, K] -> q8_0, rounding as llama.cpp's quantize_row_q8_0 does."""
    rows, cols = weight.shape
    blocks = weight.detach().float().reshape(rows, cols // BLOCK, BLOCK)
    scales = blocks.abs().amax(dim=-1) / 127.0
    inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    qs = torch.round(blocks * inverse.unsqueeze(-1)).to(torch.int8)
    return QuantizedWeight("q8_0", (rows, cols), qs.reshape(rows, cols), scales.contiguous())


# GGUF block layouts (ggml-common.h): fp16 scale (and min), then the quants.
_GGUF_BLOCKS = {
    "Q8_0": np.dtype([("d", "<f2"), ("qs", "i1", 32)]),
    "Q4_0": np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    "Q4_1": np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
}
GGUF_KINDS = tuple(_GGUF_BLOCKS)


def from_gguf_blocks(raw: np.ndarray, gguf_type: str, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF Q8_0/Q4_0/Q4_1 tensor's raw bytes (rows of blocks) as a QuantizedWeight."""
    rows, cols = shape
    blocks = np.ascontiguousarray(raw).view(_GGUF_BLOCKS[gguf_type]).reshape(rows, cols // BLOCK)
    scales = torch.from_numpy(blocks["d"].astype(np.float32))
    qs = torch.from_numpy(np.ascontiguousarray(blocks["qs"]).reshape(rows, -1))
    if gguf_type == "Q8_0":
        return QuantizedWeight("q8_0", shape, qs, scales)
    if gguf_type == "Q4_1":
        mins = torch.from_numpy(blocks["m"].astype(np.float32))
    else:  # Q4_0: w = d * (q - 8)
        mins = scales * -8.0
    return QuantizedWeight("q4_1", shape, qs, scales, mins)


def needs_kernels(weights: dict[str, torch.Tensor | QuantizedWeight], mode: str) -> bool:
    """Whether loading `weights` in quantization `mode` computes with the quantized kernels."""
    if mode == "none":
        return False
    return mode == "q8_0" or any(isinstance(w, QuantizedWeight) for w in weights.values())
