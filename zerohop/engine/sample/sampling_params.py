"""Per-request generation parameters (vLLM's names and defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from zerohop.engine.base.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_N = 128  # choices per request (OpenAI's limit)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it
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
    # Penalties and filters, as vLLM defines them (the neutral value is the default).
    presence_penalty: float = 0.0  # [-2, 2], once per token seen in the output
    frequency_penalty: float = 0.0  # [-2, 2], per occurrence in the output
    repetition_penalty: float = 1.0  # > 0, on tokens of the prompt and the output
    min_p: float = 0.0  # [0, 1], of the most likely token's probability
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    min_tokens: int = 0  # no EOS / stop token before this many output tokens
    bad_words: list[str] | None = None  # words never generated (vLLM: tokenized both ways)
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    n: int = 1  # choices from one prompt (prefilled once, its KV blocks shared)
    # An llguidance grammar (zerohop.engine.structured.grammar builds one from a JSON
    # schema, regex, choice or Lark grammar); the output must match it.
    grammar: str | None = None
    # Thought tokens (`<think>` ... `</think>`) before the thought is closed by force
    # (zerohop.engine.sample.thought_budget); `thought_open`: the prompt opened the thought.
    thinking_budget: int | None = None
    thought_open: bool = False

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
        self._validate_penalties()
        if isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be between 1 and {MAX_N}, got {self.n}")
        self._validate_thinking_budget()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}"
            )

    def _validate_thinking_budget(self) -> None:
        budget = self.thinking_budget
        if budget is None:
            return
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise InvalidRequestError(f"thinking_budget must be an integer >= 0, got {budget!r}")
        if self.grammar is not None:
            raise InvalidRequestError("thinking_budget cannot be combined with a grammar")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise InvalidRequestError(f"{name} must be between -2 and 2, got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidRequestError(
                f"repetition_penalty must be above 0, got {self.repetition_penalty}"
            )
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise InvalidRequestError(f"min_p must be between 0 and 1, got {self.min_p}")
        if self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        for token, bias in (self.logit_bias or {}).items():
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise InvalidRequestError(
                    f"logit_bias for token {token} must be between -100 and 100, got {bias}"
                )
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidRequestError("allowed_token_ids must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
