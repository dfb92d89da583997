"""The model's shape as its config.json states it (ModelConfig, RopeConfig), read and checked
for the architectures the decoder implements."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerohop.engine.base.errors import ModelLoadError
from zerohop.engine.model import gemma3
from zerohop.engine.model.gemma3 import Gemma3Config

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    gemma3.ARCHITECTURE,
)
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "OlmoeForCausalLM")
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] | None = None  # GGUF `rope_freqs`: divisors per frequency
    attention_factor: float = 1.0  # cos and sin are scaled by it (YaRN's mscale)
    beta_fast: float = 32.0  # YaRN's ramp: dims rotating faster than this keep their frequency
    beta_slow: float = 1.0  # ... and slower than this are interpolated by `factor`
    truncate: bool = True  # YaRN's correction range rounded outward to whole dims
    rotary_dim: int | None = None  # rotate only this many leading dims of a head (Phi-3)
    # LongRoPE (Phi-3.5, Phi-4-mini): divisors per frequency within the original context, and
    # the ones for a context past it (rope.py picks by the context served, as llama.cpp does).
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None


@dataclass(slots=True)
class ExpertConfig:
    """A sparse MLP's shape (Qwen3-MoE): `count` experts, `used` of them per token."""

    count: int
    used: int
    intermediate_size: int
    norm_topk_prob: bool  # renormalize the chosen experts' weights to sum to one
    sparse_step: int = 1  # every sparse_step-th layer is sparse (transformers' decoder_sparse_step)
    dense_layers: tuple[int, ...] = ()  # transformers' mlp_only_layers

    def in_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # RMSNorm on each head of q and k before RoPE (Qwen3)
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    experts: ExpertConfig | None = None  # mixture of experts (moe.py): None, every layer dense
    qk_norm_whole: bool = False  # the q and k norms span all heads' projection (OLMoE)
    gemma3: Gemma3Config | None = None  # Gemma 3's local/global layers, norms, scales

    def moe_layer(self, layer: int) -> bool:
        return self.experts is not None and self.experts.in_layer(layer)

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = model_dir / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: file not found (a Hugging Face model folder needs one)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        arch = _architecture(raw, source)
        if arch == gemma3.ARCHITECTURE:  # transformers leaves its class defaults out of the file
            raw = {**gemma3.DEFAULTS, **raw}
        fields = _ConfigReader(raw, source)
        hidden = fields.int("hidden_size")
        heads = fields.int("num_attention_heads")
        gemma = None
        if arch == gemma3.ARCHITECTURE:
            gemma = gemma3.from_dict(raw, fields.int("num_hidden_layers"), source)
            raw = gemma3.global_rope_params(raw)
        else:
            _reject_unsupported(raw, source)
        eos = raw.get("eos_token_id")
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_layers=fields.int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=fields.int("num_key_value_heads", heads),
            head_dim=fields.int("head_dim", hidden // heads),
            intermediate_size=fields.int("intermediate_size"),
            vocab_size=fields.int("vocab_size"),
            max_position_embeddings=fields.int("max_position_embeddings", 2048),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope_config(raw, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            qk_norm=arch in (*QK_NORM_ARCHITECTURES, gemma3.ARCHITECTURE),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            experts=_expert_config(raw, fields, arch) if arch in MOE_ARCHITECTURES else None,
            qk_norm_whole=arch == "OlmoeForCausalLM",
            gemma3=gemma,
        )


class _ConfigReader:
    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw, self.source = raw, source

    def int(self, name: str, default: int | None = None) -> int:
        value = self.raw.get(name, default)
        if value is None:
            raise ModelLoadError(f"{self.source}: required field '{name}' is missing")
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelLoadError(f"{self.source}: field '{name}' must be a positive integer")
        return value


def _expert_config(raw: dict[str, Any], fields: _ConfigReader, arch: str) -> ExpertConfig:
    # transformers 5 saves Qwen3-MoE's `num_experts` as `num_local_experts`.
    count_name = "num_experts" if "num_experts" in raw else "num_local_experts"
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ModelLoadError(f"{fields.source}: field 'mlp_only_layers' must be a list of ints")
    experts = ExpertConfig(
        count=fields.int(count_name),
        used=fields.int("num_experts_per_tok"),
        # OLMoE's experts are intermediate_size wide (it has no dense MLP)
        intermediate_size=fields.int(
            "intermediate_size" if arch == "OlmoeForCausalLM" else "moe_intermediate_size"
        ),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        sparse_step=fields.int("decoder_sparse_step", 1),
        dense_layers=tuple(dense),
    )
    if experts.used > experts.count:
        raise ModelLoadError(
            f"{fields.source}: field 'num_experts_per_tok' = {experts.used} exceeds"
            f" '{count_name}' = {experts.count}"
        )
    return experts


def _architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return str(arch)
    raise ModelLoadError(
        f"{source}: field 'architectures' is {archs!r};"
        f" supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _reject_unsupported(raw: dict[str, Any], source: str) -> None:
    if raw.get("mlp_bias"):
        raise ModelLoadError(f"{source}: field 'mlp_bias' = true is not supported")
    if raw.get("clip_qkv") is not None:
        raise ModelLoadError(f"{source}: field 'clip_qkv' = {raw['clip_qkv']} is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(
            f"{source}: field 'hidden_act' = {raw['hidden_act']!r} is not supported"
        )
    window = raw.get("sliding_window")
    if window is not None and (raw.get("use_sliding_window", True) is not False):
        max_pos = raw.get("max_position_embeddings", 2048)
        if window < max_pos:
            raise ModelLoadError(
                f"{source}: field 'sliding_window' = {window} (below max_position_embeddings"
                f" {max_pos}) is not supported"
            )


def _rope_config(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; older versions `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type in ("su", "yarn") and "Phi3ForCausalLM" in (raw.get("architectures") or []):
        rope_type = "longrope"  # what transformers' Phi3Config makes of them
    field_name = "rope_parameters" if "rope_parameters" in raw else "rope_scaling"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: field '{field_name}' has rope type {rope_type!r}; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    rope = RopeConfig(theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))))
    rope.type = rope_type
    rope.rotary_dim = _rotary_dim(raw, params, source)
    if rope_type in ("linear", "llama3"):
        rope.factor = float(params["factor"])
    if rope_type == "yarn":
        _read_yarn(rope, raw, params)
    if rope_type == "longrope":
        _read_longrope(rope, raw, params, f"{source}: field '{field_name}'")
    if rope_type == "llama3":
        rope.low_freq_factor = float(params["low_freq_factor"])
        rope.high_freq_factor = float(params["high_freq_factor"])
        rope.original_max_position_embeddings = int(params["original_max_position_embeddings"])
    return rope


def _rotary_dim(raw: dict[str, Any], params: dict[str, Any], source: str) -> int | None:
    """How many leading dims of each head RoPE rotates, where less than the head
    (transformers 5 keeps `partial_rotary_factor` in the rope parameters)."""
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial == 1.0:
        return None
    if "Phi3ForCausalLM" not in (raw.get("architectures") or []):
        raise ModelLoadError(f"{source}: field 'partial_rotary_factor' is not supported")
    return int(_head_dim(raw) * partial)


def _head_dim(raw: dict[str, Any]) -> int:
    heads = raw.get("num_attention_heads") or 1
    return int(raw.get("head_dim") or raw.get("hidden_size", 0) // heads)


def _read_yarn(rope: RopeConfig, raw: dict[str, Any], params: dict[str, Any]) -> None:
    """YaRN's parameters as transformers' `_compute_yarn_parameters` reads them."""
    max_pos = raw.get("max_position_embeddings", 2048)
    # A top-level `original_max_position_embeddings` wins, as transformers' standardizing does.
    original = raw.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings", max_pos
    )
    factor = params.get("factor")
    rope.factor = float(max_pos / original if factor is None else factor)
    rope.original_max_position_embeddings = int(original)
    rope.attention_factor = yarn_attention_factor(
        rope.factor,
        params.get("attention_factor"),
        params.get("mscale"),
        params.get("mscale_all_dim"),
    )
    rope.beta_fast = float(params.get("beta_fast") or 32)
    rope.beta_slow = float(params.get("beta_slow") or 1)
    rope.truncate = bool(params.get("truncate", True))


def _read_longrope(
    rope: RopeConfig, raw: dict[str, Any], params: dict[str, Any], where: str
) -> None:
    """LongRoPE as transformers' `_compute_longrope_parameters` reads it."""
    max_pos = raw.get("max_position_embeddings", 2048)
    original = raw.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings", max_pos
    )
    factor = params.get("factor") or max_pos / original
    given = params.get("attention_factor")
    rope.original_max_position_embeddings = int(original)
    rope.attention_factor = (
        float(given) if given is not None else longrope_attention_factor(factor, original)
    )
    count = (rope.rotary_dim or _head_dim(raw)) // 2
    for name in ("short_factor", "long_factor"):
        values = params.get(name)
        if not isinstance(values, list) or len(values) != count:
            raise ModelLoadError(f"{where}: '{name}' must list {count} numbers")
        setattr(rope, name, tuple(float(v) for v in values))


def longrope_attention_factor(factor: float, original: int) -> float:
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


def yarn_attention_factor(
    factor: float, given: float | None, mscale: float | None, mscale_all_dim: float | None
) -> float:
    """cos/sin's scale: the given one, else 0.1 * ln(factor) + 1 (over its mscale_all_dim twin
    where both mscales are set, as DeepSeek's configs do)."""
    if given is not None:
        return float(given)
    if mscale and mscale_all_dim:
        return _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
    return _mscale(factor, 1.0)


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
