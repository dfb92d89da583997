"""llama.cpp's K-quants (Q4_K, Q5_K, Q6_K) kept compact in memory and multiplied as they are.

Super-blocks of 256 weights along K, in sub-blocks of 32 (Q6_K: 16) with small integer scales:
  q4_k: w = d * sc * q - dmin * m,   q 0..15, sc and m 6-bit per 32, fp16 d and dmin per 256
  q5_k: the same with q 0..31 (a fifth bit from a separate plane)
  q6_k: w = d * sc * (q - 32),        q 0..63, int8 sc per 16, fp16 d per 256
A `KQuantWeight` holds, per row: the low nibbles as q4_1 does (`qs` [N, K / 2], in each block of
32 element j low and j + 16 high), q5_k's fifth bits (`high` [N, K / 8], bit i of byte j is
element 8j + i) or q6_k's top two (`high` [N, K / 4], bits 2i..2i+1 of byte j: element 4j + i),
the sub-block scales (uint8 [N, K / 32]; q6_k int8 [N, K / 16]) and mins (uint8 [N, K / 32]),
and d, dmin as float16 [N, K / 256]. Bytes per 256 weights, resident against the file's:
q4_k 148 / 144 (+2.8%), q5_k 180 / 176 (+2.3%), q6_k 210 / 210 (the same). The panels the
kernels multiply (`pack_panels`, kernels/kquant.h) hold the same bytes rearranged.

Q5_0 and Q5_1, what llama-quantize writes for a Q4_K or Q5_K file's rows that are not a multiple
of 256, share q5_k's nibbles and fifth-bit plane, with float16 d (and dmin = -m) per block of
32 and no sub-block scales (`scales` empty): q5_0 w = d (q - 16), q5_1 w = d q - dmin; 176 and
192 bytes per 256 weights, as in the file.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from zerohop.engine.model.quant import PanelRows, QuantizedWeight

SUPER = 256
K_KINDS = ("q4_k", "q5_k", "q6_k", "q5_0", "q5_1")
GGUF_K_KINDS = {"Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k", "Q5_0": "q5_0", "Q5_1": "q5_1"}
FILE_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210, "q5_0": 176, "q5_1": 192}  # per 256
BLOCK_KINDS = ("q5_0", "q5_1")  # d (and m) per block of 32, no sub-block scales
_NONE = torch.empty(0, dtype=torch.uint8)  # an absent part, for the kernels' fixed six tensors


@dataclass(slots=True)
class KQuantWeight(QuantizedWeight):
    """One [N, K] K-quant matrix (see the module docstring); `scales` and `mins` are the
    sub-blocks' integer scales and mins, `d` and `dmin` the super-blocks' float16 ones."""

    high: torch.Tensor | None = None
    d: torch.Tensor = _NONE
    dmin: torch.Tensor | None = None

    def __post_init__(self) -> None:
        assert self.kind in K_KINDS, self.kind
        rows, cols = self.shape
        span = super_size(self.kind)
        assert cols % span == 0, f"K must be a multiple of {span}"
        assert tuple(self.qs.shape) == (rows, cols // 2)
        assert tuple(self.d.shape) == (rows, cols // span) and self.d.dtype == torch.float16
        assert (self.high is None) == (self.kind == "q4_k")
        assert (self.dmin is None) == (self.kind in ("q6_k", "q5_0"))
        assert (self.mins is None) == (self.kind in ("q6_k", *BLOCK_KINDS))

    @property
    def parts(self) -> tuple[torch.Tensor | None, ...]:
        scales = None if self.kind in BLOCK_KINDS else self.scales  # empty: q5_0/q5_1 have none
        return (self.qs, self.high, scales, self.mins, self.d, self.dmin)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts if t is not None)

    def with_parts(self, parts: list[torch.Tensor | None], rows: int) -> KQuantWeight:
        qs, high, scales, mins, d, dmin = parts
        assert qs is not None and d is not None
        scales = _NONE if scales is None else scales
        return KQuantWeight(self.kind, (rows, self.shape[1]), qs, scales, mins, high, d, dmin)

    def stacked(self, weights: list[QuantizedWeight]) -> QuantizedWeight:
        ks = [w for w in weights if isinstance(w, KQuantWeight)]
        assert len(ks) == len(weights) and all(w.kind == self.kind for w in ks)
        columns = zip(*(w.parts for w in ks), strict=True)
        parts = [None if p[0] is None else torch.cat(list(p)) for p in columns]
        return self.with_parts(parts, sum(w.shape[0] for w in ks))

    def permute_rows(self, order: torch.Tensor) -> QuantizedWeight:
        parts = [None if t is None else t.index_select(0, order).contiguous() for t in self.parts]
        return self.with_parts(parts, self.shape[0])

    def values(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The integers q [n, K] (uint8: q4_k 0..15, q5_k, q5_0, q5_1 0..31, q6_k 0..63)."""
        pick = lambda t: t if rows is None else t.index_select(0, rows)  # noqa: E731
        packed = pick(self.qs)
        count = packed.shape[0]
        blocks = packed.view(count, -1, 16)
        q = torch.cat((blocks & 0x0F, blocks >> 4), dim=-1).reshape(count, -1)
        if self.high is None:
            return q
        high = pick(self.high)
        bits = 2 if self.kind == "q6_k" else 1
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
        top = (high.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return q | (top.reshape(count, -1) << 4)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 matrix (as gguf.quants.dequantize computes it), or only `rows`."""
        if rows is None:
            return _floats(self.kind, self.values(), self.scales, self.mins, self.d, self.dmin)
        parts = self.parts[2:]
        picked = (None if t is None else t.index_select(0, rows) for t in parts)
        return _floats(self.kind, self.values(rows), *picked)

    def kernel_tensors(self) -> list[torch.Tensor]:
        """The six row-major tensors the kernels' fallback takes (absent ones empty)."""
        return [_NONE if t is None else t for t in self.parts]


def super_size(kind: str) -> int:
    """Weights along K per d: 256 (a super-block), or 32 for q5_0 and q5_1."""
    return 32 if kind in BLOCK_KINDS else SUPER


def _floats(
    kind: str,
    q: torch.Tensor,
    scales: torch.Tensor | None,
    mins: torch.Tensor | None,
    d: torch.Tensor,
    dmin: torch.Tensor | None,
) -> torch.Tensor:
    """Rows of integers q [n, K] with their scales as float32 weights [n, K]."""
    count, cols = q.shape
    if kind in BLOCK_KINDS:  # q5_0: d (q - 16); q5_1: d q + m, held as dmin = -m
        values = q.float().view(count, cols // 32, 32)
        scale = d.float().unsqueeze(-1)
        if dmin is None:
            return (scale * (values - 16.0)).reshape(count, cols)
        return (scale * values - dmin.float().unsqueeze(-1)).reshape(count, cols)
    assert scales is not None
    sub = 16 if kind == "q6_k" else 32
    per = SUPER // sub
    scale = (d.float().repeat_interleave(per, dim=1) * scales.float()).unsqueeze(-1)
    values = q.float().view(count, cols // sub, sub)
    if kind == "q6_k":
        return (scale * (values - 32.0)).reshape(count, cols)
    assert mins is not None and dmin is not None
    offset = (dmin.float().repeat_interleave(per, dim=1) * mins.float()).unsqueeze(-1)
    return (scale * values - offset).reshape(count, cols)


@dataclass(slots=True)
class KPanelRows(PanelRows):
    """A K-quant matrix held only as the kernels' panels (`pack_panels`' six tensors), read a
    row at a time: a tied embedding looked up from its output layer's weights."""

    kind: str = "q4_k"
    panels: tuple[torch.Tensor, ...] = ()

    def dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        panel, lane = rows // 16, rows % 16
        count, (q, high, scales, mins, d, dmin) = rows.shape[0], self.panels
        blocks = q.shape[1]
        # q's byte [.., g, 2i + c] holds columns 4g + c (low nibble) and 4g + 2 + c (high).
        bytes_ = q[panel].view(count, blocks, 8, 16, 2)[torch.arange(count), :, :, lane]
        values = torch.stack((bytes_ & 0x0F, bytes_ >> 4), dim=-2)  # [n, blocks, 8, 2, 2]
        if self.kind != "q4_k":
            planes = high[panel].view(count, blocks, -1, 16, 2)[torch.arange(count), :, :, lane]
            bits = 2 if self.kind == "q6_k" else 1
            shifts = torch.arange(0, 8, bits, dtype=torch.uint8).view(1, 1, 8 // bits, 1, 1)
            # Field f of plane j: group g = j * (8 // bits // 2) + f // 2, its pair f % 2.
            top = (planes.unsqueeze(2) >> shifts) & ((1 << bits) - 1)  # [n, blocks, f, j, c]
            top = top.permute(0, 1, 3, 2, 4).reshape(count, blocks, 8, 2, 2)
            values = values | (top << 4)
        # [n, ...] of a [P, ..., 16]; absent parts (empty) stay absent
        lanes = lambda t: None if t.numel() == 0 else t[panel, ..., lane].reshape(count, -1)  # noqa: E731
        held = [lanes(t) for t in (scales, mins, d, dmin)]
        assert held[2] is not None
        return _floats(self.kind, values.reshape(count, -1), held[0], held[1], held[2], held[3])


def tied_panel_rows(
    weight: KQuantWeight, kind: str, panels: tuple[torch.Tensor, ...]
) -> KPanelRows:
    """`weight`, a tied embedding, read from its output layer's panels (kind "<k>_panels")."""
    assert kind == f"{weight.kind}_panels"
    return KPanelRows(weight.shape, panels[0], panels[2], weight.kind, panels)


def _scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes a super-block -> eight 6-bit scales and eight 6-bit mins."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mins


def _low_nibbles(q: np.ndarray, rows: int) -> torch.Tensor:
    """Integers [rows, K] -> q4_1-style nibbles [rows, K / 2]."""
    blocks = q.reshape(rows, -1, 2, 16) & 0x0F
    return torch.from_numpy((blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(rows, -1))


def _planes(top: np.ndarray, rows: int, bits: int) -> torch.Tensor:
    """Top bits [rows, K] -> `bits`-bit fields packed into bytes, element order."""
    fields = top.reshape(rows, -1, 8 // bits).astype(np.uint8)
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    packed = np.bitwise_or.reduce(fields << shifts, axis=-1).astype(np.uint8)
    return torch.from_numpy(packed.reshape(rows, -1))


def from_gguf_kquant(raw: np.ndarray, gguf_type: str, shape: tuple[int, int]) -> KQuantWeight:
    """A GGUF Q4_K/Q5_K/Q6_K (or Q5_0/Q5_1) tensor's raw bytes (rows of blocks) as a
    KQuantWeight."""
    kind = GGUF_K_KINDS[gguf_type]
    if kind in BLOCK_KINDS:
        return _from_gguf_q5(raw, kind, shape)
    rows, cols = shape
    supers = cols // SUPER
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows * supers, FILE_BYTES[kind])
    f16 = lambda b: torch.from_numpy(b.copy().view(np.float16).reshape(rows, supers))  # noqa: E731
    if kind == "q6_k":
        ql, qh = blocks[:, :128].reshape(-1, 2, 1, 64), blocks[:, 128:192].reshape(-1, 2, 1, 32)
        low = ((ql >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(-1, 256)
        top = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 0x03
        scales = torch.from_numpy(blocks[:, 192:208].copy().view(np.int8).reshape(rows, -1))
        return KQuantWeight(
            kind, shape, _low_nibbles(low, rows), scales, None,
            _planes(top.reshape(-1, 256), rows, 2), f16(blocks[:, 208:210]), None,
        )  # fmt: skip
    sc, mins = _scale_min(blocks[:, 4:16])
    qs = blocks[:, -128:].reshape(-1, 4, 1, 32)
    low = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(-1, 256)
    high = None
    if kind == "q5_k":
        qh = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        high = _planes((qh & 1).reshape(-1, 256), rows, 1)
    return KQuantWeight(
        kind, shape, _low_nibbles(low, rows), torch.from_numpy(sc.reshape(rows, -1).copy()),
        torch.from_numpy(mins.reshape(rows, -1).copy()), high, f16(blocks[:, 0:2]),
        f16(blocks[:, 2:4]),
    )  # fmt: skip


def _from_gguf_q5(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> KQuantWeight:
    """Q5_0 (d, qh, qs) or Q5_1 (d, m, qh, qs) blocks of 32: the nibbles are q4_1's already,
    and qh's little-endian bit e is element e's fifth bit, as `high` holds it."""
    rows, cols = shape
    fields = [("d", "<f2"), ("m", "<f2")] if kind == "q5_1" else [("d", "<f2")]
    layout = np.dtype([*fields, ("qh", "u1", 4), ("qs", "u1", 16)])
    blocks = np.ascontiguousarray(raw).view(np.uint8).view(layout).reshape(rows, cols // 32)
    as_torch = lambda a: torch.from_numpy(np.ascontiguousarray(a).reshape(rows, -1))  # noqa: E731
    dmin = as_torch(-blocks["m"]) if kind == "q5_1" else None  # w = d q - dmin
    return KQuantWeight(
        kind, shape, as_torch(blocks["qs"]), _NONE, None, as_torch(blocks["qh"]),
        as_torch(blocks["d"]), dmin,
    )  # fmt: skip


def pack_panels(weight: KQuantWeight) -> list[torch.Tensor]:
    """The weight in the kernels' panels of 16 rows (kernels/kquant.h), P = ceil(N / 16):
    nibbles [P, blocks, 8, 32] as q4_1's panels; q5_k's fifth bits [P, blocks, 2, 32] (byte t
    of plane g / 4: bit 2 (g % 4) the first pair of group g, the next bit its second); q6_k's
    top bits [P, blocks, 4, 32] (plane g / 2: bits 4 (g % 2) the first, + 2 the second); scales
    [P, blocks, 16] (q6_k [P, blocks, 2, 16] int8, the two halves), mins [P, blocks, 16],
    d and dmin [P, supers, 16] float16. Missing rows are zero."""
    rows, cols = weight.shape
    panels = (rows + 15) // 16
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, panels * 16 - rows))  # noqa: E731
    by_panel = lambda t: pad(t).view(panels, 16, -1).transpose(1, 2).contiguous()  # noqa: E731
    blocks = cols // 32
    q = pad(weight.values()).view(panels, 16, blocks, 16, 2).permute(0, 2, 3, 1, 4)
    q = q.reshape(panels, blocks, 8, 2, 32)
    low = q & 0x0F
    out = [(low[:, :, :, 0] | (low[:, :, :, 1] << 4)).contiguous()]
    top = q >> 4
    if weight.kind in ("q5_k", *BLOCK_KINDS):
        fields = (
            top.reshape(panels, blocks, 2, 8, 32) << torch.arange(8, dtype=torch.uint8)[:, None]
        )
        out.append(_or_fields(fields))
    elif weight.kind == "q6_k":
        shifts = torch.arange(0, 8, 2, dtype=torch.uint8)[:, None]
        out.append(_or_fields(top.reshape(panels, blocks, 4, 4, 32) << shifts))
    else:
        out.append(_NONE)
    if weight.kind in BLOCK_KINDS:
        out += [_NONE, _NONE]
    elif weight.kind == "q6_k":
        out.append(by_panel(weight.scales).view(panels, blocks, 2, 16))
        out.append(_NONE)
    else:
        assert weight.mins is not None
        out += [by_panel(weight.scales), by_panel(weight.mins)]
    out.append(by_panel(weight.d))
    out.append(_NONE if weight.dmin is None else by_panel(weight.dmin))
    return out


def _or_fields(fields: torch.Tensor) -> torch.Tensor:
    """[..., F, 32] bit fields, each already shifted to its place, OR-ed into [..., 32]."""
    out = fields[..., 0, :].clone()
    for i in range(1, fields.shape[-2]):
        out |= fields[..., i, :]
    return out.contiguous()
