"""Per-request generation parameters (vLLM's names and defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from zerohop.engine.errors import InvalidRequestError

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # as vLLM: smaller temperatures overflow softmax; treat them as greedy


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per output token, N <= 20
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        if not (math.isfinite(self.temperature) and math.isfinite(self.top_p)):
            raise InvalidRequestError("temperature and top_p must be finite numbers")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
