"""A Messages API SSE stream checked as a strict client reads it, from its raw bytes: every
event named and its data JSON of the same type, message_start first and message_stop
last, content blocks opened in index order, each delta of its block's kind on the open
block, every block closed before message_delta, tool inputs that parse, no error event,
and nothing cut short. `check_stream` returns what a report needs (usage, stop reason,
block types) or raises AssertionError saying what is wrong and where."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from zerohop import sse

# The delta kinds each block type may receive.
DELTAS = {
    "text": {"text_delta", "citations_delta"},
    "tool_use": {"input_json_delta"},
    "thinking": {"thinking_delta", "signature_delta"},
    "redacted_thinking": set(),
}


@dataclass
class Stream:
    """What one well-formed stream said."""

    usage: dict[str, Any] = field(default_factory=dict)  # message_start's, then the delta's
    stop_reason: str | None = None
    blocks: list[str] = field(default_factory=list)  # block types in index order
    tool_inputs: list[Any] = field(default_factory=list)


def check_stream(body: bytes) -> Stream:
    assert body.endswith((b"\n\n", b"\r\n\r\n")), f"stream cut short: ...{body[-200:]!r}"
    events = [_event(e) for e in sse.parse(body) if e.name is not None or e.data is not None]
    assert events, "no events"
    kinds = [kind for kind, _ in events if kind != "ping"]
    assert kinds[0] == "message_start", kinds[:3]
    assert kinds[-2:] == ["message_delta", "message_stop"], kinds[-3:]
    stream = Stream()
    state = _Blocks(stream)
    for kind, data in events:
        assert kind != "error", f"error event: {data}"
        if kind == "message_start":
            stream.usage = dict(data["message"]["usage"])
        elif kind == "message_delta":
            assert state.open is None, f"block {state.open} still open at message_delta"
            stream.stop_reason = data["delta"]["stop_reason"]
            stream.usage |= data.get("usage") or {}
        elif kind.startswith("content_block_"):
            state.feed(kind, data)
    assert stream.stop_reason, "message_delta without a stop_reason"
    return stream


def _event(event: sse.Event) -> tuple[str, dict[str, Any]]:
    assert event.name is not None and event.data is not None, f"event without name/data: {event}"
    name = event.name.decode()
    data = json.loads(event.data)
    assert data.get("type") == name, f"event {name!r} carries data of type {data.get('type')!r}"
    return name, data


@dataclass
class _Blocks:
    stream: Stream
    open: int | None = None
    kind: str = ""
    partial_json: str = ""

    def feed(self, kind: str, data: dict[str, Any]) -> None:
        index = data["index"]
        if kind == "content_block_start":
            assert self.open is None, f"block {index} opened while {self.open} is open"
            assert index == len(self.stream.blocks), f"block {index} out of order"
            self.open, self.kind = index, data["content_block"]["type"]
            assert self.kind in DELTAS, f"unknown block type {self.kind!r}"
            self.stream.blocks.append(self.kind)
            self.partial_json = ""
            return
        assert index == self.open, f"{kind} for block {index}; open: {self.open}"
        if kind == "content_block_delta":
            delta = data["delta"]["type"]
            assert delta in DELTAS[self.kind], f"{delta} on a {self.kind} block"
            self.partial_json += data["delta"].get("partial_json", "")
        else:
            assert kind == "content_block_stop", kind
            if self.kind == "tool_use":
                self.stream.tool_inputs.append(json.loads(self.partial_json or "{}"))
            self.open = None
