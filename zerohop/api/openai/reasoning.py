"""Reasoning on the OpenAI chat surface: for a model with a reasoning format (reasoning.py),
each choice's thought is `message.reasoning_content` (and vLLM's `reasoning`, the same text)
and the rest is `content`; streamed, each chunk's delta carries the thought's new text as
`reasoning_content` / `reasoning` and the answer's as `content`. `reasoning_effort` is
accepted and ignored. With tools, calls are read in the answer after the thought
(openai_tools.ToolChatStream); a forced call or a response format is not split (its
grammar writes the answer from the first token).

vLLM's `thinking_token_budget` closes the thought by force after that many tokens
(zerohop.engine.sample.thought_budget); on a model without a reasoning format, or with a forced
grammar, it is a 400.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson

from zerohop.api.conversation.reasoning import OPEN, ReasoningParser
from zerohop.api.errors import ApiError
from zerohop.api.openai.output import LogprobFormatter
from zerohop.api.openai.stream import ChatStream
from zerohop.engine.outputs import RequestDelta
from zerohop.engine.sample.sampling_params import SamplingParams


def split_reasoning(text: str, in_thought: bool) -> tuple[str | None, str]:
    """(the thought, or None when there was none; the answer)."""
    thought, answer = ReasoningParser(in_thought).feed(text, final=True)
    opened = in_thought or text.lstrip().startswith(OPEN)
    return (thought if opened else None), answer


def with_thinking_budget(
    params: SamplingParams, budget: int | None, reasoning: bool, opened: bool
) -> SamplingParams:
    """`params` with the request's `thinking_token_budget`; `reasoning`: the model has a
    reasoning format; `opened`: the prompt opened the thought."""
    if budget is None:
        return params
    if not reasoning:
        raise ApiError(
            400,
            "thinking_token_budget: the model has no reasoning format (no <think> in its"
            " chat template)",
            param="thinking_token_budget",
        )
    if params.grammar is not None:
        raise ApiError(
            400,
            "thinking_token_budget: not supported with a forced tool call or structured output",
            param="thinking_token_budget",
        )
    return replace(params, thinking_budget=budget, thought_open=opened)


def reasoning_fields(thought: str | None) -> dict[str, Any]:
    return {"reasoning_content": thought, "reasoning": thought}


class ReasoningChatStream(ChatStream):
    """A ChatStream whose chunks split each choice's output into thought and answer."""

    def __init__(self, *args: Any, in_thought: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parsers = [ReasoningParser(in_thought) for _ in range(self.choices.n)]

    def step(self, formatter: LogprobFormatter, delta: RequestDelta) -> bytes:
        if delta.finished and not delta.new_token_ids:  # flush what the parser holds back
            return self.content(formatter, delta) + super().step(formatter, delta)
        return super().step(formatter, delta)

    def content(self, formatter: LogprobFormatter, delta: RequestDelta) -> bytes:
        thought, answer = self.parsers[delta.index].feed(delta.new_text, final=delta.finished)
        fields: dict[str, Any] = reasoning_fields(thought) if thought else {}
        if answer or not thought:
            fields["content"] = answer
        logprobs = self.logprobs(formatter, delta) if delta.new_logprobs is not None else None
        choice: dict[str, Any] = {"index": delta.index, "delta": fields}
        choice["logprobs"] = orjson.Fragment(logprobs) if logprobs else None
        choice["finish_reason"] = None
        if self.token_ids:
            choice["token_ids"] = delta.new_token_ids
        return self.head + orjson.dumps(choice) + b"]" + self.tail
