"""The Hermes tool-call format (Qwen2.5, Qwen3, SmolLM3 and many fine-tunes): calls are
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the model's text.

Parsing is incremental: `feed` takes each new piece of text as it is decoded and returns
what can be told apart so far, plain text (streamed at once, except a possible start of a
tag, held back until it is decided) and whole calls. A call whose JSON does not parse,
names no known tool or (given a ToolSet) has arguments its tool's schema refuses, is given
back as text, exactly as the model wrote it, never as a broken tool call.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from zerohop.api.tools.forced import CLOSE, OPEN
from zerohop.api.tools.jsonscan import loads, partial_tag
from zerohop.api.tools.spec import ToolCall, ToolSet


@dataclass(slots=True)
class Parsed:
    """What a piece of output held: text, whole calls, and (forced_stream.py only) a call
    streamed as it is decoded: its name once read, then its arguments' text piece by piece.
    The whole call comes in `calls` once it ends: a reader that streams it has sent it all."""

    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    opened: str | None = None  # a streamed call's tool name, as soon as it is read
    fragment: str = ""  # more of the streamed call's arguments (JSON text as decoded)


class HermesParser:
    def __init__(self, tool_names: Collection[str]) -> None:
        self.tool_names = tool_names
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        out = Parsed()
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    return out
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE) :]
                self._in_call = False
                self._emit_call(body, out)
                continue
            start = self._buffer.find(OPEN)
            if start < 0:
                keep = partial_tag(self._buffer, OPEN)
                out.text += self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return out
            out.text += self._buffer[:start]
            self._buffer = self._buffer[start + len(OPEN) :]
            self._in_call = True

    def finish(self) -> Parsed:
        """The end of the output: whatever is still held is text (an unclosed call too)."""
        rest = (OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return Parsed(text=rest)

    def _emit_call(self, body: str, out: Parsed) -> None:
        call = parse_call(body, self.tool_names)
        if call is None:
            out.text += OPEN + body + CLOSE
        else:
            out.calls.append(call)


def parse_call(body: str, tool_names: Collection[str]) -> ToolCall | None:
    """The call in a `<tool_call>` body, or None when it is not a valid call."""
    return call_from(loads(body), tool_names)


def call_from(value: Any, tool_names: Collection[str]) -> ToolCall | None:
    """The call a decoded JSON value names (its `arguments` or `parameters`), or None.
    With a ToolSet the arguments must also follow the tool's schema."""
    if not isinstance(value, dict) or value.get("name") not in tool_names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = loads(arguments)
    if not isinstance(arguments, dict):
        return None
    if isinstance(tool_names, ToolSet) and not tool_names.valid(value["name"], arguments):
        return None
    return ToolCall(value["name"], arguments)
