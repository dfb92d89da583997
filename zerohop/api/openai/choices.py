"""Whole (not streamed) OpenAI answers: each of a request's `n` choices accumulated over its
deltas, then as the response's `choices`, sorted by index, and its usage (the prompt once,
the completion tokens of every choice)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zerohop.api.conversation.events import OutputReader
from zerohop.api.openai.events_stream import answer_message
from zerohop.api.openai.output import Choices, LogprobFormatter, Totals, legacy_columns
from zerohop.engine.base.outputs import RequestDelta


class ChatAnswer:
    def __init__(
        self,
        prompt_tokens: int,
        n: int,
        top: int | None,
        formatter: LogprobFormatter,
        readers: Callable[[], OutputReader] | None = None,
    ) -> None:
        self.choices = Choices(prompt_tokens, n)
        self.top, self.formatter = top, formatter
        self.readers = readers  # set: each choice read for its thought and calls
        self.logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]

    def add(self, delta: RequestDelta) -> None:
        self.choices.add(delta)
        if self.top is not None and delta.new_logprobs is not None:
            self.logprobs[delta.index].extend(self.formatter.chat(delta, self.top))

    def body(self) -> list[dict[str, Any]]:
        return [self._choice(i, totals) for i, totals in enumerate(self.choices.totals)]

    def _choice(self, i: int, totals: Totals) -> dict[str, Any]:
        text, reason = "".join(totals.text), totals.finish_reason
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.readers is not None:
            message, called = answer_message(self.readers(), text)
            reason = "tool_calls" if called else reason
        return {
            "index": i,
            "message": message,
            "logprobs": None if self.top is None else {"content": self.logprobs[i]},
            "finish_reason": reason,
            "stop_reason": totals.stop_reason,
        }

    def usage(self) -> dict[str, Any]:
        return self.choices.usage()


class CompletionAnswer:
    def __init__(self, prompt_tokens: int, n: int, echo: str, formatter: LogprobFormatter) -> None:
        self.choices = Choices(prompt_tokens, n)
        self.echo, self.formatter = echo, formatter
        self.logprobs: list[dict[str, list] | None] = [None] * n
        self.offsets = [0] * n  # each choice's text_offset so far

    def add(self, delta: RequestDelta) -> None:
        self.choices.add(delta)
        if delta.new_logprobs is not None:
            i = delta.index
            columns = self.logprobs[i] = self.logprobs[i] or legacy_columns()
            self.offsets[i] = self.formatter.legacy(delta, columns, self.offsets[i])

    def body(self) -> list[dict[str, Any]]:
        return [
            {
                "index": i,
                "text": self.echo + "".join(totals.text),
                "logprobs": self.logprobs[i],
                "finish_reason": totals.finish_reason,
                "stop_reason": totals.stop_reason,
            }
            for i, totals in enumerate(self.choices.totals)
        ]

    def usage(self) -> dict[str, Any]:
        return self.choices.usage()
