"""A chat answer read as the neutral output events (api/conversation/events.py), streamed or
whole: the thought as `reasoning_content` (and vLLM's `reasoning`), the text as `content`,
the calls as `tool_calls`.

A streamed call the reader reads as decoded (a forced one) goes out as a `tool_calls` delta
with its index, id, type, name and arguments "" once its name is read, then one per piece of
its arguments' text; every other call once whole and valid, in the same shape (its opening,
then all its arguments). A token whose output went out in a tool or thought delta still gets
its content chunk when it carries more than text (logprobs, token ids).
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import orjson

from zerohop.api.conversation.events import (
    CallArguments,
    CallEnd,
    CallStart,
    Event,
    OutputReader,
    Text,
    Thought,
)
from zerohop.api.openai.output import LogprobFormatter
from zerohop.api.openai.stream import ChatStream, _index
from zerohop.api.tools.spec import ToolCall
from zerohop.engine.base.outputs import RequestDelta

_ALNUM = string.ascii_letters + string.digits


def call_id() -> str:
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def openai_call(call: ToolCall) -> dict[str, Any]:
    arguments = json.dumps(call.arguments)
    return {
        "id": call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }


def reasoning_fields(thought: str | None) -> dict[str, Any]:
    return {"reasoning_content": thought, "reasoning": thought}


def answer_message(reader: OutputReader, text: str) -> tuple[dict[str, Any], bool]:
    """A whole answer's message, and whether it made calls."""
    events = reader.feed(text, final=True)
    content = "".join(e.text for e in events if isinstance(e, Text))
    calls = [e.call for e in events if isinstance(e, CallEnd)]
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["content"] = content or None
        message["tool_calls"] = [openai_call(c) for c in calls]
    if reader.thoughts is not None:
        message.update(reasoning_fields(reader.thought if reader.thought_opened else None))
    return message, bool(calls)


class EventChatStream(ChatStream):
    """A chat stream whose every choice is read by its own OutputReader."""

    def __init__(self, *args: Any, readers: Callable[[], OutputReader], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.readers = [readers() for _ in range(self.choices.n)]

    def step(self, formatter: LogprobFormatter, delta: RequestDelta) -> bytes:
        totals = self.choices.add(delta)
        i = delta.index
        events = self.readers[i].feed(delta.new_text, final=delta.finished)
        text = "".join(e.text for e in events if isinstance(e, Text))
        thought = "".join(e.text for e in events if isinstance(e, Thought))
        data = self._delta(i, reasoning_fields(thought)) if thought else b""
        calls = b"".join(self._call_delta(i, e) for e in events)
        quiet = calls or thought  # the token's output went out in another delta
        if text or (delta.new_token_ids and (not quiet or self._per_token(delta))):
            data += self.content(formatter, replace(delta, new_text=text))
        data += calls
        if delta.finished:
            reason = "tool_calls" if self.readers[i].found else totals.finish_reason
            stop_reason = orjson.dumps(totals.stop_reason)
            data += self.head + self.finish_choice(i, reason, stop_reason) + b"]" + self.tail
        return data

    def _per_token(self, delta: RequestDelta) -> bool:
        return delta.new_logprobs is not None or self.token_ids

    def _call_delta(self, index: int, event: Event) -> bytes:
        match event:
            case CallStart(k, name):
                function = {"name": name, "arguments": ""}
                opening = {"index": k, "id": call_id(), "type": "function", "function": function}
                return self._delta(index, {"tool_calls": [opening]})
            case CallArguments(k, fragment):
                return self._delta(index, {"tool_calls": [{"index": k, "function": {
                    "arguments": fragment}}]})  # fmt: skip
            case CallEnd(k, call, False):
                whole = openai_call(call)
                opening = {**whole, "index": k, "function": {"name": call.name, "arguments": ""}}
                arguments = {"index": k, "function": {"arguments": whole["function"]["arguments"]}}
                return self._delta(index, {"tool_calls": [opening]}) + self._delta(
                    index, {"tool_calls": [arguments]}
                )
        return b""

    def _delta(self, index: int, fields: dict[str, Any]) -> bytes:
        delta = orjson.dumps(fields)
        return (
            self.head + _index(index) + b',"delta":' + delta
            + b',"logprobs":null,"finish_reason":null}]' + self.tail
        )  # fmt: skip
