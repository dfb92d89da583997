"""A response's output items, built from the conversation's events (api/conversation/events.py),
and, for a stream, the API's events for each, in its order:

- a thought: a `reasoning` item (`response.output_item.added`, `response.content_part.added`
  of a `reasoning_text` part, `response.reasoning_text.delta` per piece, then `.done`,
  `response.content_part.done`, `response.output_item.done`);
- text: a `message` item the same way, its part `output_text` (`response.output_text.delta`);
- a call: a `function_call` item (`response.function_call_arguments.delta` / `.done`) or, for
  a custom tool, a `custom_tool_call` item (`response.custom_tool_call_input.delta` /
  `.done`). A call read as it is decoded (a forced one) streams its arguments or input
  piece by piece; any other call is given out whole once valid (its added event, one delta,
  its done events).

One item is open at a time: a new kind of output closes the one before it. Each item keeps
its `id` (rs_, msg_, fc_, ctc_) and each call its `call_id` (call_).
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Any

import orjson

from zerohop.api.conversation.events import (
    CallArguments,
    CallEnd,
    CallStart,
    Event,
    Text,
    Thought,
    ThoughtEnd,
)
from zerohop.api.responses.tools import RequestTools
from zerohop.api.tools.raw_input import INPUT

_ALNUM = string.ascii_letters + string.digits


def new_id(prefix: str, size: int = 24) -> str:
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(size))


class EventWriter:
    """SSE events with the stream's running `sequence_number`; `enabled` False (a response
    sent whole) writes nothing."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        if not self.enabled:
            return b""
        data = orjson.dumps({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


class OutputItems:
    """The output items of one response, as its events come. `raw_input`: the output is a
    forced custom call's raw input, streamed as decoded (tools/raw_input.py)."""

    def __init__(self, tools: RequestTools, write: EventWriter, raw_input: bool = False) -> None:
        self.tools, self.write, self.raw_input = tools, write, raw_input
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._text: list[str] = []  # the open item's text, arguments or input so far

    @property
    def calls(self) -> int:
        return sum(i["type"] in ("function_call", "custom_tool_call") for i in self.items)

    def feed(self, events: list[Event]) -> bytes:
        return b"".join(self._event(e) for e in events)

    def finish(self, status: str = "completed") -> bytes:
        """Close the open item (`status`: completed, or incomplete when the output was cut)."""
        return self._close(status)

    def _event(self, event: Event) -> bytes:
        match event:
            case Thought(text):
                return self._piece("reasoning", text)
            case ThoughtEnd():
                return self._close() if self._kind == "reasoning" else b""
            case Text(text):
                return self._piece("message", text) if text else b""
            case CallStart(_, name):
                return self._close() + self._open_call(name)
            case CallArguments(_, fragment):
                return self._call_piece(fragment)
            case CallEnd(_, call, streamed):
                if streamed:
                    return self._close()
                data = self._close() + self._open_call(call.name)
                return data + self._call_piece(self._whole(call.name, call.arguments), True)
        return b""

    @property
    def _kind(self) -> str | None:
        return None if self._open is None else self._open["type"]

    # -- text and thoughts -----------------------------------------------------------------

    def _piece(self, kind: str, text: str) -> bytes:
        data = b""
        if self._kind != kind:
            data = self._close() + self._open_item(kind)
        self._text.append(text)
        at = {**self._at(), "content_index": 0, "delta": text}
        if kind == "reasoning":
            return data + self.write("response.reasoning_text.delta", **at)
        return data + self.write("response.output_text.delta", **at, logprobs=[])

    def _open_item(self, kind: str) -> bytes:
        if kind == "reasoning":
            item = {"id": new_id("rs_"), "type": "reasoning", "summary": [], "content": []}
        else:
            item = {"id": new_id("msg_"), "type": "message", "role": "assistant", "content": []}
        item["status"] = "in_progress"
        data = self._added(item)
        part = _part(kind, "")
        at = {**self._at(), "content_index": 0}
        return data + self.write("response.content_part.added", **at, part=part)

    # -- calls -----------------------------------------------------------------------------

    def _open_call(self, name: str) -> bytes:
        offered = self.tools.offered.get(name)
        call_id = new_id("call_")
        shown = offered.name if offered else name
        if offered is not None and offered.kind == "custom":
            item = {"id": new_id("ctc_"), "type": "custom_tool_call", "call_id": call_id}
            item.update(name=shown, input="")
        else:
            item = {"id": new_id("fc_"), "type": "function_call", "call_id": call_id}
            item.update(name=shown, arguments="", status="in_progress")
        if offered is not None and offered.namespace is not None:
            item["namespace"] = offered.namespace
        return self._added(item)

    def _call_piece(self, fragment: str, whole: bool = False) -> bytes:
        """More of the open call's arguments (or input); a custom call read as JSON (not as
        raw input) gives its input out once whole."""
        if self._kind == "custom_tool_call" and not (self.raw_input or whole):
            return b""
        self._text.append(fragment)
        custom = self._kind == "custom_tool_call"
        kind = "custom_tool_call_input" if custom else "function_call_arguments"
        return self.write(f"response.{kind}.delta", **self._at(), delta=fragment)

    def _whole(self, name: str, arguments: dict[str, Any]) -> str:
        if self.tools.is_custom(name):
            raw = arguments.get(INPUT)
            return raw if isinstance(raw, str) else json.dumps(arguments)
        return json.dumps(arguments)

    # -- items -----------------------------------------------------------------------------

    def _added(self, item: dict[str, Any]) -> bytes:
        self._open, self._text = item, []
        self.items.append(item)
        return self.write("response.output_item.added", output_index=len(self.items) - 1, item=item)

    def _close(self, status: str = "completed") -> bytes:
        item = self._open
        if item is None:
            return b""
        self._open = None
        text = "".join(self._text)
        kind = item["type"]
        if kind == "function_call":
            item.update(arguments=text, status=status)
            at = self._at(item)
            done = self.write("response.function_call_arguments.done", **at, arguments=text)
        elif kind == "custom_tool_call":
            item["input"] = text
            done = self.write("response.custom_tool_call_input.done", **self._at(item), input=text)
        else:
            done = self._close_part(item, kind, text)
            item["status"] = status
        index = self.items.index(item)
        return done + self.write("response.output_item.done", output_index=index, item=item)

    def _close_part(self, item: dict[str, Any], kind: str, text: str) -> bytes:
        part = _part(kind, text)
        item["content"] = [part]
        at = {**self._at(item), "content_index": 0}
        if kind == "reasoning":
            done = self.write("response.reasoning_text.done", **at, text=text)
        else:
            done = self.write("response.output_text.done", **at, text=text, logprobs=[])
        return done + self.write("response.content_part.done", **at, part=part)

    def _at(self, item: dict[str, Any] | None = None) -> dict[str, Any]:
        item = item or self._open
        assert item is not None
        return {"item_id": item["id"], "output_index": self.items.index(item)}


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
