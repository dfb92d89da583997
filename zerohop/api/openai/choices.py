"""Whole (not streamed) OpenAI answers: each of a request's `n` choices accumulated over the
generation's steps, then as the response's `choices`, sorted by index, and its usage (the
prompt once, the completion tokens of every choice)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zerohop.api.conversation.events import CallEnd, Text
from zerohop.api.generation.events import Finish, Step, Usage
from zerohop.api.openai.events_stream import openai_call, reasoning_fields
from zerohop.api.openai.output import LogprobFormatter, legacy_columns, openai_usage
from zerohop.api.tools.spec import ToolCall


@dataclass(slots=True)
class Choice:
    """One choice's output so far."""

    text: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    finish: Finish | None = None

    def add(self, step: Step) -> None:
        for event in step.output:
            if isinstance(event, Text):
                self.text.append(event.text)
            elif isinstance(event, CallEnd):
                self.calls.append(event.call)
        if step.finish is not None:
            self.finish = step.finish

    def reason_fields(self) -> dict[str, Any]:
        assert self.finish is not None
        return {"finish_reason": self.finish.reason.value, "stop_reason": self.finish.stop}


class Answer:
    def __init__(self, n: int, formatter: LogprobFormatter) -> None:
        self.choices = [Choice() for _ in range(n)]
        self.formatter = formatter
        self.usage: Usage | None = None

    def add(self, step: Step) -> None:
        self.choices[step.choice].add(step)
        if step.finish is not None:
            self.usage = step.finish.usage

    def usage_body(self) -> dict[str, Any]:
        assert self.usage is not None
        return openai_usage(self.usage)


class ChatAnswer(Answer):
    """`thinks`: the output is read for a thought (its reasoning fields are always there)."""

    def __init__(
        self, n: int, top: int | None, formatter: LogprobFormatter, thinks: bool = False
    ) -> None:
        super().__init__(n, formatter)
        self.top, self.thinks = top, thinks
        self.logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]

    def add(self, step: Step) -> None:
        super().add(step)
        if self.top is not None and step.logprobs is not None:
            self.logprobs[step.choice].extend(self.formatter.chat(step, self.top))

    def body(self) -> list[dict[str, Any]]:
        return [self._choice(i, choice) for i, choice in enumerate(self.choices)]

    def _choice(self, i: int, choice: Choice) -> dict[str, Any]:
        text = "".join(choice.text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if choice.calls:
            message["content"] = text or None
            message["tool_calls"] = [openai_call(c) for c in choice.calls]
        if self.thinks and choice.finish is not None:
            message.update(reasoning_fields(choice.finish.thought))
        return {
            "index": i,
            "message": message,
            "logprobs": None if self.top is None else {"content": self.logprobs[i]},
            **choice.reason_fields(),
        }


class CompletionAnswer(Answer):
    def __init__(self, n: int, echo: str, formatter: LogprobFormatter) -> None:
        super().__init__(n, formatter)
        self.echo = echo
        self.logprobs: list[dict[str, list[Any]] | None] = [None] * n
        self.offsets = [0] * n  # each choice's text_offset so far

    def add(self, step: Step) -> None:
        super().add(step)
        if step.logprobs is not None:
            i = step.choice
            columns = self.logprobs[i] = self.logprobs[i] or legacy_columns()
            self.offsets[i] = self.formatter.legacy(step, columns, self.offsets[i])

    def body(self) -> list[dict[str, Any]]:
        return [
            {
                "index": i,
                "text": self.echo + "".join(choice.text),
                "logprobs": self.logprobs[i],
                **choice.reason_fields(),
            }
            for i, choice in enumerate(self.choices)
        ]
