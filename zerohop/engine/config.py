"""Model configuration (parsed from config.json) and engine options."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zerohop.engine.errors import ModelLoadError
from zerohop.engine.sched.background_share import DEFAULT_BACKGROUND_SHARE
from zerohop.engine.sched.prefill_budget import DEFAULT_INTER_TOKEN_TARGET

if TYPE_CHECKING:
    from zerohop.engine.sched.speculative import SpeculativeConfig

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
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
        fields = _ConfigReader(raw, source)
        arch = _architecture(raw, source)
        hidden = fields.int("hidden_size")
        heads = fields.int("num_attention_heads")
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
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
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


def _architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ModelLoadError(
        f"{source}: field 'architectures' is {archs!r};"
        f" supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _reject_unsupported(raw: dict[str, Any], source: str) -> None:
    if raw.get("mlp_bias"):
        raise ModelLoadError(f"{source}: field 'mlp_bias' = true is not supported")
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
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{source}: field 'partial_rotary_factor' is not supported")


def _rope_config(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; older versions `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        field_name = "rope_parameters" if "rope_parameters" in raw else "rope_scaling"
        raise ModelLoadError(
            f"{source}: field '{field_name}' has rope type {rope_type!r}; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    rope = RopeConfig(theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))))
    rope.type = rope_type
    if rope_type != "default":
        rope.factor = float(params["factor"])
    if rope_type == "llama3":
        rope.low_freq_factor = float(params["low_freq_factor"])
        rope.high_freq_factor = float(params["high_freq_factor"])
        rope.original_max_position_embeddings = int(params["original_max_position_embeddings"])
    return rope


QUANTIZATION_MODES = ("auto", "q8_0", "none")
SCHEDULING_POLICIES = ("vtc", "fcfs")


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Seconds a step with running decodes aims to take: its prompt tokens are cut to what the
    # measured step costs say fits (zerohop.engine.sched.prefill_budget); 0: no limit.
    inter_token_target: float = DEFAULT_INTER_TOKEN_TARGET
    # Seconds background requests (batch lines) wait after foreground work before a step of
    # their own: a client's next request usually comes within it, and then it does not wait
    # for their step (zerohop.engine.sched.scheduler); 0: they step at once. benchmarks/batches.py,
    # default model, one interactive client beside a batch: TTFT p50 1.44x idle at 0.05 s
    # (the next request came later than that under load), 1.11x at 0.15, 1.12x at 0.3.
    background_linger: float = 0.15
    # The share of a foreground step's measured cost that background rows beside it may add
    # (zerohop.engine.sched.background_share); 0: they run only in steps of their own.
    background_step_share: float = DEFAULT_BACKGROUND_SHARE
    block_size: int = 16
    kv_cache_memory: float | None = None  # GiB; None: 1 GiB on CPU, a fraction of free on CUDA
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # exact pool size, overrides kv_cache_memory
    dtype: str = "auto"
    device: str = "auto"
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    num_threads: int | None = None
    # auto: quantized GGUF matrices stay compact (Q8_0/Q4_0/Q4_1 as they are, other types as
    # q8_0), float weights stay float; q8_0: float matrices too; none: everything float.
    quantization: str = "auto"
    # Run every step through the Python forward pass, never the C++ decode step (vLLM's name
    # for not replaying captured graphs).
    enforce_eager: bool = False
    # vtc: weighted fair share between tenants (sched/fair_share.py); fcfs: arrival order.
    scheduling_policy: str = "vtc"
    fair_share_token_weights: tuple[float, float] = (1.0, 2.0)  # input, output token
    seed: int = 0
    step_delay: float = 0.0  # seconds slept after each engine-process step (tests only)
    # Speculative decoding by prompt lookup (zerohop.engine.sched.speculative; vLLM's ngram
    # method): tokens proposed per step (0: off) and the n-gram sizes looked up.
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # Step times an earlier start of this engine measured ({"decode": [[size, s], ...],
    # "prefill": ...}, StepTimes.table()): the supervisor's restart passes them, and the start
    # skips its calibration (the machine and model have not changed).
    step_times: dict[str, list[list[float]]] | None = None

    def __post_init__(self) -> None:
        assert self.block_size > 0 and self.max_num_seqs > 0
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        target = self.inter_token_target
        if isinstance(target, bool) or not isinstance(target, int | float):
            raise ValueError(f"inter_token_target must be a number of seconds; got {target!r}")
        if not math.isfinite(target) or target < 0:
            raise ValueError(f"inter_token_target must be finite and >= 0; got {target!r}")
        linger = self.background_linger
        if isinstance(linger, bool) or not isinstance(linger, int | float):
            raise ValueError(f"background_linger must be a number of seconds; got {linger!r}")
        if not math.isfinite(linger) or linger < 0:
            raise ValueError(f"background_linger must be finite and >= 0; got {linger!r}")
        share = self.background_step_share
        if isinstance(share, bool) or not isinstance(share, int | float):
            raise ValueError(f"background_step_share must be a number; got {share!r}")
        if not math.isfinite(share) or share < 0:
            raise ValueError(f"background_step_share must be finite and >= 0; got {share!r}")
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_MODES)};"
                f" got {self.quantization!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)};"
                f" got {self.scheduling_policy!r}"
            )
        weights = tuple(self.fair_share_token_weights)
        if len(weights) != 2 or min(weights) < 0 or max(weights) == 0:
            raise ValueError(
                "fair_share_token_weights must be two non-negative numbers, not both 0"
            )
        self.speculative()  # its own checks
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}; got {self.dtype!r}")

    def speculative(self) -> SpeculativeConfig:
        from zerohop.engine.sched.speculative import SpeculativeConfig

        n, low, high = self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max
        return SpeculativeConfig(n, low, high)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]
