"""A chat answer streamed from the neutral output events (api/conversation/events.py): the
thought as `reasoning_content` (and vLLM's `reasoning`), the text as `content`, the calls as
`tool_calls`.

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
from dataclasses import replace
from typing import Any

import orjson

from zerohop.api.conversation.events import (
    CallArguments,
    CallEnd,
    CallStart,
    Event,
    Text,
    Thought,
)
from zerohop.api.generation.events import Step
from zerohop.api.openai.stream import ChatStream, choice_index
from zerohop.api.tools.spec import ToolCall

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


class EventChatStream(ChatStream):
    """A chat stream whose choices' output comes as events: the thought, the text, the calls."""

    def step(self, step: Step) -> bytes:
        i, events = step.choice, step.output
        text = "".join(e.text for e in events if isinstance(e, Text))
        thought = "".join(e.text for e in events if isinstance(e, Thought))
        data = self._delta(i, reasoning_fields(thought)) if thought else b""
        calls = b"".join(self._call_delta(i, e) for e in events)
        quiet = calls or thought  # the token's output went out in another delta
        if text or (step.token_ids and (not quiet or self._per_token(step))):
            data += self.content(replace(step, text=text))
        return data + calls + self.finish_chunk(step)

    def _per_token(self, step: Step) -> bool:
        return step.logprobs is not None or self.token_ids

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
            self.head + choice_index(index) + b',"delta":' + delta
            + b',"logprobs":null,"finish_reason":null}]' + self.tail
        )  # fmt: skip
