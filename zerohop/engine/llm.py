"""The offline API: `LLM(model_path).generate(prompts, params)`, in the spirit of vLLM's."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Unpack

from zerohop.engine.base.options import EngineOptions
from zerohop.engine.base.outputs import RequestDelta
from zerohop.engine.config import EngineConfig
from zerohop.engine.engine import LLMEngine
from zerohop.engine.sample.sampling_params import SamplingParams
from zerohop.engine.sched.policy import SchedulingPolicy
from zerohop.engine.text.tokenizer import Tokenizer

Prompt = str | list[int]
NEVER_STARTED = "this choice never started: its request failed before its first token"


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cached_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None
    index: int = 0  # which of the request's `n` choices

    def apply(self, delta: RequestDelta) -> None:
        self.token_ids.extend(delta.new_token_ids)
        self.text += delta.new_text
        if delta.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.new_logprobs
        self.cached_tokens = delta.cached_tokens
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason
            self.error = delta.error


class LLM:
    """Runs the engine in this process and returns finished outputs in prompt order (a
    request with `n` > 1 choices gives n outputs in a row, by `index`)."""

    def __init__(
        self,
        model_path: str | Path,
        policy: SchedulingPolicy | None = None,
        **engine_options: Unpack[EngineOptions],
    ) -> None:
        self.engine = LLMEngine(model_path, EngineConfig(**engine_options), policy)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        param_list = _as_params_list(params, len(prompt_list))
        outputs: dict[tuple[str, int], RequestOutput] = {}
        for prompt, p in zip(prompt_list, param_list, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, ids, p)
            for index in range(p.n):
                outputs[(request_id, index)] = RequestOutput(request_id, ids, index=index)
        pending = set(outputs)
        while pending and self.engine.has_unfinished():
            for delta in self.engine.step():
                key = (delta.request_id, delta.index)
                if key in outputs:
                    outputs[key].apply(delta)
                    if delta.finished:
                        pending.discard(key)
        for key in pending:  # a choice never forked: its request failed before
            outputs[key].finish_reason, outputs[key].error = "error", NEVER_STARTED
        return list(outputs.values())


def _as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [[t for t in prompts if isinstance(t, int)]]  # one prompt given as token ids
    return [p for p in prompts if not isinstance(p, int)]


def _as_params_list(
    params: SamplingParams | list[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)
