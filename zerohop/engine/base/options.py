"""The engine's options as they travel: `EngineOptions`, EngineConfig's fields by name.

`zerohop.engine.config.EngineConfig` imports torch, which the API process never loads; the
CLI builds these options, the supervisor keeps them for restarts and the engine process makes
its EngineConfig from them (`EngineConfig(**options)`, which the type checker holds to these
keys). tests/test_engine_seam_types.py holds the keys equal to EngineConfig's fields.
"""

from __future__ import annotations

from typing import Any, TypedDict


class EngineOptions(TypedDict, total=False):
    """Any subset of EngineConfig's fields; an absent one takes EngineConfig's default."""

    max_num_seqs: int
    max_num_batched_tokens: int
    inter_token_target: float
    background_linger: float
    background_step_share: float
    block_size: int
    kv_cache_memory: float | None
    gpu_memory_utilization: float
    num_kv_blocks: int | None
    dtype: str
    device: str
    enable_prefix_caching: bool
    max_model_len: int | None
    num_threads: int | None
    quantization: str
    enforce_eager: bool
    scheduling_policy: str
    fair_share_token_weights: tuple[float, float]
    seed: int
    step_delay: float
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    step_times: dict[str, list[list[float]]] | None
    # vLLM's own engine arguments (--vllm-arg NAME=VALUE, --engine vllm only): their values
    # are whatever vLLM's AsyncEngineArgs takes, so Any; zerohop's engine refuses any.
    vllm_args: dict[str, Any] | None
