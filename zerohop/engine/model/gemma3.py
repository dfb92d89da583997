"""Gemma 3 text models' own settings (Gemma3ForCausalLM, GGUF `gemma3`): which layers attend
through a local sliding window (with their own RoPE base) and which globally, the attention
scale, and the (1 + w) RMSNorm weights. Read from config.json as transformers'
Gemma3TextConfig reads it (`layer_types`, else every `sliding_window_pattern`-th layer global;
`rope_local_base_freq` or transformers 5's per-layer-type `rope_parameters`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from zerohop.engine.base.errors import ModelLoadError

ARCHITECTURE = "Gemma3ForCausalLM"
LOCAL_THETA, GLOBAL_THETA = 10000.0, 1_000_000.0
LAYER_TYPES = ("sliding_attention", "full_attention")
# Gemma3TextConfig's defaults, which transformers may leave out of a saved config.json.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}


@dataclass(slots=True)
class Gemma3Config:
    sliding_window: int  # a local layer's query at p sees keys at positions > p - window
    sliding: tuple[bool, ...]  # per layer: local (True) or global
    local_theta: float  # the local layers' RoPE base, unscaled (global: ModelConfig.rope)
    query_pre_attn_scalar: float  # attention scale = this ** -0.5
    # Added to the stored norm weights at load: 1.0 for a Hugging Face folder (Gemma's RMSNorm
    # multiplies by 1 + w); 0.0 for a GGUF file, whose converter stored w + 1 already.
    norm_offset: float = 1.0

    def window(self, layer: int) -> int:
        """The layer's attention window; 0 for a global layer."""
        return self.sliding_window if self.sliding[layer] else 0


def embed_scale(hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """sqrt(hidden_size) in the embedding's dtype, as transformers' scaled embedding has it."""
    return torch.tensor(hidden_size**0.5).to(dtype)


def reject_unsupported(raw: dict[str, Any], source: str) -> None:
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(name) is not None:
            raise ModelLoadError(f"{source}: field '{name}' = {raw[name]} is not supported")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: field 'use_bidirectional_attention' is not supported")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{source}: field 'hidden_activation' = {act!r} is not supported")


def from_dict(raw: dict[str, Any], num_layers: int, source: str) -> Gemma3Config:
    reject_unsupported(raw, source)
    window = raw.get("sliding_window", 4096)
    if not isinstance(window, int) or window <= 0:
        raise ModelLoadError(f"{source}: field 'sliding_window' must be a positive integer")
    scalar = raw.get("query_pre_attn_scalar", 256)
    if not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ModelLoadError(f"{source}: field 'query_pre_attn_scalar' must be positive")
    params = raw.get("rope_parameters") or {}
    local = params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ModelLoadError(
            f"{source}: field 'rope_parameters' gives sliding_attention layers rope type"
            f" {local['rope_type']!r}; supported: default"
        )
    theta = local.get("rope_theta", raw.get("rope_local_base_freq", LOCAL_THETA))
    return Gemma3Config(
        sliding_window=window,
        sliding=_sliding_layers(raw, num_layers, source),
        local_theta=float(theta),
        query_pre_attn_scalar=float(scalar),
    )


def global_rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """The global layers' RoPE settings in the flat form config.py reads: transformers 5 nests
    them under rope_parameters' `full_attention`; older configs give rope_theta (default 1e6)
    and rope_scaling."""
    params = raw.get("rope_parameters") or {}
    flat = dict(raw)
    flat.pop("rope_parameters", None)
    if "full_attention" in params:
        flat["rope_scaling"] = dict(params["full_attention"])
    flat.setdefault("rope_theta", GLOBAL_THETA)
    return flat


def sliding_pattern(num_layers: int, pattern: int) -> tuple[bool, ...]:
    """Every `pattern`-th layer global, the rest local (transformers' default layer_types)."""
    return tuple(bool((i + 1) % pattern) for i in range(num_layers))


def _sliding_layers(raw: dict[str, Any], num_layers: int, source: str) -> tuple[bool, ...]:
    types = raw.get("layer_types")
    if types is None:
        pattern = raw.get("sliding_window_pattern", 6)
        if not isinstance(pattern, int) or pattern <= 0:
            raise ModelLoadError(f"{source}: field 'sliding_window_pattern' must be positive")
        return sliding_pattern(num_layers, pattern)
    if (
        not isinstance(types, list)
        or len(types) != num_layers
        or any(t not in LAYER_TYPES for t in types)
    ):
        raise ModelLoadError(
            f"{source}: field 'layer_types' must list {num_layers} of {', '.join(LAYER_TYPES)}"
        )
    return tuple(t == "sliding_attention" for t in types)


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] gate|up -> gelu_tanh(gate) * up, as transformers' Gemma3MLP."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def from_gguf(get: Callable[[str], Any], layers: int, hidden: int, heads: int, head_dim: int,
              where: str) -> Gemma3Config:  # fmt: skip
    """Gemma 3's settings from a `gemma3` GGUF file, as llama.cpp reads them: local layers
    by the file's sliding_window_pattern (else every 6th layer global) with RoPE base
    rope.freq_base_swa (else 10000); the query scale 1/sqrt(key_length), or 1/sqrt(hidden /
    heads) for the 62-layer 27B; norm weights stored as w + 1 by the converter."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if get(f"gemma3.{name}") is not None:
            raise ModelLoadError(f"{where}: field 'gemma3.{name}' is not supported")
    window = get("gemma3.attention.sliding_window")
    if not isinstance(window, int) or window <= 0:
        raise ModelLoadError(f"{where}: field 'gemma3.attention.sliding_window' must be given")
    pattern = get("gemma3.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ModelLoadError(
                f"{where}: field 'gemma3.attention.sliding_window_pattern' must list {layers}"
            )
        sliding = tuple(bool(p) for p in pattern)
    else:
        sliding = sliding_pattern(layers, pattern if isinstance(pattern, int) else 6)
    return Gemma3Config(
        sliding_window=window,
        sliding=sliding,
        local_theta=float(get("gemma3.rope.freq_base_swa") or LOCAL_THETA),
        query_pre_attn_scalar=float(hidden // heads if layers == 62 else head_dim),
        norm_offset=0.0,
    )
