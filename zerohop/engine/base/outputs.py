"""What the engine reports: per-request deltas each step, and pool/cache counters.

Torch-free, so the API process can use these without importing the model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict


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

    def as_dict(self) -> EngineStatsDict:
        """The counters as the engine process sends them and the API process reads them."""
        return EngineStatsDict(
            num_blocks=self.num_blocks,
            blocks_in_use=self.blocks_in_use,
            blocks_cached=self.blocks_cached,
            blocks_free=self.blocks_free,
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            requests_added=self.requests_added,
            tokens_per_second=self.tokens_per_second,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            block_size=self.block_size,
            step_times={
                kind: [list(row) for row in rows] for kind, rows in self.step_times.items()
            },
            step_seconds=self.step_seconds,
            remaining_tokens=list(self.remaining_tokens),
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
        )


class EngineStatsDict(TypedDict):
    """`EngineStats` as a dict (msgpack carries no classes): what `EngineClient.stats()` and
    `latest_stats` give the API process, read by key, so a misspelt key fails the type check.
    Its keys are EngineStats' fields (tests/test_engine_seam_types.py holds them equal)."""

    num_blocks: int
    blocks_in_use: int
    blocks_cached: int
    blocks_free: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_running: int
    num_waiting: int
    requests_added: int
    tokens_per_second: float
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    step_times: dict[str, list[list[float]]]
    step_seconds: float
    remaining_tokens: list[int]
    spec_draft_tokens: int
    spec_accepted_tokens: int


class EngineInfo(TypedDict, total=False):
    """What an engine says of itself once started (`EngineClient.info`). Both engines give
    vocab_size, max_model_len and block_size; zerohop's the rest but `engine` and `model_dir`,
    vLLM's those two (its name, and the Hugging Face folder it serves)."""

    engine: str  # "vllm"; absent: zerohop's own
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    dtype: str
    device: str
    start_phases: dict[str, float]  # phase: seconds (zerohop.engine.start_clock)
    step_times: dict[str, list[list[float]]]  # what a restart reuses (EngineStats.step_times)
    model_dir: str
