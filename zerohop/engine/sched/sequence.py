"""One request's state inside the engine: its tokens, cache blocks and progress."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from zerohop.engine.sample.sampling_params import SamplingParams

if TYPE_CHECKING:
    import llguidance
    import torch

    from zerohop.engine.sample.thought_budget import ThoughtBudget
    from zerohop.engine.text.detokenizer import IncrementalDetokenizer

_arrivals = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never past the model's context
    tenant: str = "default"
    weight: float = 1.0
    priority: int = 0
    cache_salt: str | None = None
    arrival: int = field(default_factory=lambda: next(_arrivals))
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained, one per full block
    num_committed_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache (first admission)
    num_preemptions: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    matcher: llguidance.LLMatcher | None = None  # the request's grammar state, if constrained
    thought: ThoughtBudget | None = None  # its thinking budget's state, if it has one
    # Speculation backoff (zerohop.engine.sched.speculative): proposals refused in a row, and the
    # output length before which the next proposal waits.
    spec_misses: int = 0
    spec_resume_at: int = 0
    spec_length: int = 1  # tokens its next proposal may have (see speculative.Speculator)

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "a prompt needs at least one token"
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
