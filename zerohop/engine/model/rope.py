"""Rotary position embeddings: the default, `linear`, `llama3`, `yarn` and `longrope` schemes.

Computed the way transformers computes them (float32 inverse frequencies, cos/sin of the
outer product times the attention factor, `rotate_half` layout), so logits match Hugging Face
bit for bit. LongRoPE's factors are chosen once, by the context served (`--max-model-len`, else
the model's): the long ones where it passes the original context, as llama.cpp chooses by its
context size. transformers chooses them by each sequence's length; the two agree wherever the
context served and the sequence lie on the same side of the original context. With a partial
rotary (Phi-3's `partial_rotary_factor`) the tables cover only the rotated leading dims of each
head; the rest pass through.
"""

from __future__ import annotations

import math

import torch

from zerohop.engine.model.config import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig, context: int = 0) -> torch.Tensor:
    """One frequency per pair of rotated dims; `context`: the positions the model serves
    (LongRoPE takes its long factors where that passes the original context)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if rope.type == "longrope":
        long = context > rope.original_max_position_embeddings
        factors = rope.long_factor if long else rope.short_factor
        assert factors is not None, "LongRoPE needs its factors"
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.freq_factors is not None:
        assert len(rope.freq_factors) == len(inv_freq), "one rope_freqs factor per frequency"
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        return _llama3_frequencies(inv_freq, rope)
    if rope.type == "yarn":
        return _yarn_frequencies(head_dim, rope)
    return inv_freq


def _llama3_frequencies(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_frequencies(dim: int, rope: RopeConfig) -> torch.Tensor:
    """transformers' `_compute_yarn_parameters`: fast dims keep their frequency, slow ones are
    divided by `factor`, with a linear ramp between beta_fast and beta_slow rotations."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (rope.factor * pos_freqs)
    low, high = _yarn_correction_range(dim, rope)
    if low == high:
        high += 0.001  # no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep


def _yarn_correction_range(dim: int, rope: RopeConfig) -> tuple[float, float]:
    def correction_dim(rotations: float) -> float:
        length = rope.original_max_position_embeddings
        return (dim * math.log(length / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


class RotaryEmbedding:
    """A cos/sin table for every position, indexed per token at run time: [P, rotary_dim]."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        rope: RopeConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        context: int | None = None,
    ) -> None:
        self.rotary_dim = rope.rotary_dim or head_dim
        inv_freq = inverse_frequencies(self.rotary_dim, rope, context or max_positions)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * rope.attention_factor).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * rope.attention_factor).to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, [T, 1, D]: once per step, shared by every layer."""
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        return cos, sin


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, Hkv, D], cos/sin from `RotaryEmbedding.lookup` ([T, 1, R]): the
    first R dims of each head rotated, the rest as they are."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    turned, kept = x[..., :rotary], x[..., rotary:]
    return torch.cat((turned * cos + _rotate_half(turned) * sin, kept), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
