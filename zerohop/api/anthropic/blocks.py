"""The neutral output events (api/conversation/events.py) as Messages content blocks: whole
for a response, or as the stream's `content_block_*` events.

- A request that thinks (and is not constrained: see the planner) begins with a `thinking`
  block at index 0, signed for the request's model and tenant (thought_signatures.py);
  streamed as thinking_delta events, then a signature_delta, then its stop. The answer's
  blocks follow.
- With tools, content is [a text block, when the text before the first call is not blank]
  + the calls; text after the first call is dropped (as vLLM's Hermes parser does). Blank
  text is held back until it is decided. A response with no call holds one text block,
  possibly empty, as without tools.
- A forced call streams as it is decoded: `content_block_start` once its name is read, an
  `input_json_delta` per piece of its input, `content_block_stop`. Other calls stream once
  whole and valid for their schema (an invalid one is text): the start, one delta, the stop.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
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
from zerohop.api.serving.thought_signatures import ThoughtSigner
from zerohop.api.tools.spec import ToolCall

_ID_ALPHABET = string.ascii_letters + string.digits


def tool_use_id() -> str:
    return "toolu_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_use_id(), "name": call.name, "input": call.arguments}


def thinking_block(thought: str, signer: ThoughtSigner) -> dict[str, Any]:
    return {"type": "thinking", "thinking": thought, "signature": signer.sign(thought)}


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (name.encode(), orjson.dumps({"type": name, **data}))


@dataclass(slots=True)
class ContentBlocks:
    """One response's content, fed the reader's events; `thinking`: a thinking block leads,
    signed by `signer`; `tools`: the tool rules of the module docstring apply to the text."""

    thinking: bool
    tools: bool
    signer: ThoughtSigner | None = None  # set when `thinking`
    index: int = -1
    block_open: bool = False
    thought: str = ""
    text: str = ""
    pending: str = ""  # blank text held back
    calls: list[dict[str, Any]] = field(default_factory=list)
    open: dict[str, Any] | None = None  # the tool_use block being streamed

    def opening(self) -> bytes:
        """The events that go out with message_start."""
        if not self.thinking:
            return b""
        return self._start({"type": "thinking", "thinking": "", "signature": ""})

    def resume(self, events: list[Event]) -> None:
        """Take the events of a continued answer's start (a client's failover), which the
        caller has: the blocks go on where they stopped, at the same indices (a thinking
        block first, opened as `opening` did, its event dropped)."""
        self.opening()
        for event in events:
            self._event(event)

    def events(self, events: list[Event], final: bool = False) -> bytes:
        out = b"".join(self._event(e) for e in events)
        if final and self.pending and not self._called:
            out += self._text_delta(self._take_pending())
        return out

    def end(self) -> bytes:
        """The last block's stop (an empty text block first when there was no content)."""
        if self.index < (1 if self.thinking else 0):
            return self._start({"type": "text", "text": ""}) + self._stop()
        return self._stop()

    def content(self) -> list[dict[str, Any]]:
        """The response's content blocks, once the output is all fed."""
        lead = [thinking_block(self.thought, self._signer)] if self.thinking else []
        if not self.calls:
            return [*lead, {"type": "text", "text": self.text}]
        return lead + ([{"type": "text", "text": self.text}] if self.text else []) + self.calls

    @property
    def _signer(self) -> ThoughtSigner:
        if self.signer is None:
            raise RuntimeError("a response that thinks needs a signer")
        return self.signer

    @property
    def _called(self) -> bool:
        return bool(self.calls) or self.open is not None

    def _event(self, event: Event) -> bytes:
        match event:
            case Thought(text):
                self.thought += text
                return self._delta({"type": "thinking_delta", "thinking": text})
            case ThoughtEnd():
                if not self.thinking:
                    return b""
                signed = self._signer.sign(self.thought)
                return self._delta({"type": "signature_delta", "signature": signed}) + self._stop()
            case Text(text):
                return self._text(text)
            case CallStart(_, name):
                self.open = {"type": "tool_use", "id": tool_use_id(), "name": name, "input": {}}
                return self._stop() + self._start(self.open)
            case CallArguments(_, fragment):
                return self._input(fragment)
            case CallEnd(_, call, streamed):
                return self._call_end(call, streamed)
        return b""

    def _text(self, text: str) -> bytes:
        if not self.tools:
            return self._text_delta(text)
        if self._called:
            return b""
        self.pending += text
        return self._text_delta(self._take_pending()) if self.pending.strip() else b""

    def _take_pending(self) -> str:
        text, self.pending = self.pending, ""
        return text

    def _text_delta(self, text: str) -> bytes:
        if not text:
            return b""
        self.text += text
        out = b"" if self.block_open else self._start({"type": "text", "text": ""})
        return out + self._delta({"type": "text_delta", "text": text})

    def _call_end(self, call: ToolCall, streamed: bool) -> bytes:
        if streamed and self.open is not None:
            self.open["input"] = call.arguments
            self.calls.append(self.open)
            self.open = None
            return b""
        block = tool_use_block(call)
        self.calls.append(block)
        return (
            self._stop()
            + self._start({**block, "input": {}})
            + self._input(orjson.dumps(call.arguments).decode())
        )

    def _input(self, partial: str) -> bytes:
        return self._delta({"type": "input_json_delta", "partial_json": partial})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event("content_block_delta", {"index": self.index, "delta": delta})

    def _start(self, block: dict[str, Any]) -> bytes:
        self.index += 1
        self.block_open = True
        return sse_event("content_block_start", {"index": self.index, "content_block": block})

    def _stop(self) -> bytes:
        if not self.block_open:
            return b""
        self.block_open = False
        return sse_event("content_block_stop", {"index": self.index})
