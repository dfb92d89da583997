"""What the engine reports: per-request deltas each step, and pool/cache counters.

Torch-free, so the API process can use these without importing the model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestDelta:
    """What one request produced in one step."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[dict[int, float]] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_tokens_processed: int = 0  # prefilled this step (what the gateway charges)
    index: int = 0  # which of the request's `n` choices this delta belongs to
    # The engine's acknowledgement that it accepted the request (AsyncEngine makes it; no
    # tokens; cached_tokens: the prefix-cache hit expected then, `LLMEngine.prefix_hit`).
    admitted: bool = False


@dataclass(slots=True)
class EngineStats:
    num_blocks: int
    blocks_in_use: int
    blocks_cached: int
    blocks_free: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_running: int
    num_waiting: int
    requests_added: int = 0  # requests the engine accepted since it started
    tokens_per_second: float = 0.0  # tokens computed per second of step time, last seconds
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    block_size: int = 0
    # {"decode": [[requests, seconds], ...], "prefill": [[tokens, seconds], ...]}: the mean
    # step of each size (zerohop.engine.sched.step_times)
    step_times: dict[str, list[list[float]]] = field(default_factory=dict)
    step_seconds: float = 0.0  # the latest step's
    # Output tokens the running requests may still produce (max_tokens left), ascending,
    # at most 17 evenly spaced of them (throughput.quantiles)
    remaining_tokens: list[int] = field(default_factory=list)
    # Speculative decoding (zerohop.engine.sched.speculative): tokens proposed, and kept
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
