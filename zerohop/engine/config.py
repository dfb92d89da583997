"""The engine's options (EngineConfig): batch sizes, the KV cache, scheduling, speculation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from zerohop.engine.model.config import DTYPES
from zerohop.engine.sched.background_share import DEFAULT_BACKGROUND_SHARE
from zerohop.engine.sched.prefill_budget import DEFAULT_INTER_TOKEN_TARGET

if TYPE_CHECKING:
    from zerohop.engine.sched.speculative import SpeculativeConfig


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
    # vLLM's own engine arguments (EngineOptions.vllm_args): refused here, they are for
    # --engine vllm (the options' one key that is not this engine's).
    vllm_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.vllm_args:
            raise ValueError("vllm_args are vLLM's engine arguments: serve with --engine vllm")
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
