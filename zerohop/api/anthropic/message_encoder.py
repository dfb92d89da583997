"""A Messages response encoded from the generation driver's events: the stream's SSE events, or
the whole message (messages.py's docstring says what each field means)."""

from __future__ import annotations

from typing import Any

import orjson

from zerohop.api.anthropic.blocks import ContentBlocks, sse_event
from zerohop.api.anthropic.threads import ThreadTurn
from zerohop.api.errors import ApiError, anthropic_body
from zerohop.api.generation.driver import Generation
from zerohop.api.generation.events import Admitted, Finish, FinishReason, Step, Usage

_DELTA_PREFIX = (
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":'
)
_DELTA_SUFFIX = b"}}\n\n"
_DELTA_SUFFIX_IDS = b'},"token_ids":'  # `return_token_ids`: the event's tokens follow
_BLOCK_START = (
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}'
    b'\n\nevent: ping\ndata: {"type":"ping"}\n\n'
)
PING = b'event: ping\ndata: {"type":"ping"}\n\n'
_BLOCK_STOP = b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
_MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'

_STOP_REASONS = {
    FinishReason.STOP: "end_turn",
    FinishReason.LENGTH: "max_tokens",
    FinishReason.TOOL_CALLS: "tool_use",
}


def stop_fields(finish: Finish) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished message."""
    if finish.reason is FinishReason.STOP and isinstance(finish.stop, str):
        return "stop_sequence", finish.stop
    return _STOP_REASONS[finish.reason], None


def usage_body(usage: Usage) -> dict[str, int]:
    return {
        "input_tokens": usage.uncached_prompt_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.output_tokens,
    }


class MessageEncoder:
    """One message. `blocks`: set when the request has tools or thinks (the output read as
    events into content blocks); else one text block, one delta event per token."""

    ping = PING

    def __init__(self, request_id: str, model: str, token_ids: bool) -> None:
        self.rid, self.model = request_id, model
        self.suffix = _DELTA_SUFFIX_IDS if token_ids else None
        self.blocks: ContentBlocks | None = None
        self.context: dict[str, Any] | None = None  # context_management (applied edits)
        self.thread: ThreadTurn | None = None  # its answer is kept (anthropic/threads.py)
        self.text: list[str] = []
        self.finish: Finish | None = None
        self.resumed = False  # continues another replica's answer (`continue_token_ids`)

    # -- whole -----------------------------------------------------------------------------

    async def whole(self, generation: Generation) -> dict[str, Any]:
        async for step in generation.steps():
            self.step(step)
        assert self.finish is not None
        stop_reason, stop_sequence = stop_fields(self.finish)
        content = self.content()
        body = {
            **self.head(),
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage_body(self.finish.usage),
        }
        if self.context is not None:
            body["context_management"] = self.context
        if self.thread is not None:  # kept before it is sent: the next turn finds it
            await self.thread.answered(body["id"], content)
        return body

    # -- streamed (generation/sse.py) ------------------------------------------------------

    def resume(self, generation: Generation) -> None:
        """Continue another replica's answer: the continued part's blocks are open already,
        so the stream opens with message_start and a ping only, and goes on at the same
        block indices (the client drops this message_start)."""
        self.resumed = True
        if self.blocks is not None:
            self.blocks.resume(generation.resumed)
        else:
            self.text.append(generation.continued_text)

    def opening(self, admitted: Admitted) -> bytes:
        start = {**self.head(), "content": [], "stop_reason": None, "stop_sequence": None}
        start["usage"] = usage_body(admitted.usage)
        if self.resumed:
            first = PING
        else:
            first = _BLOCK_START if self.blocks is None else self.blocks.opening() + PING
        return sse_event("message_start", {"message": start}) + first

    def step(self, step: Step) -> bytes:
        self.finish = step.finish or self.finish
        if self.blocks is not None:
            out = self.blocks.events(step.output, final=step.finish is not None)
            return self._with_ids(out, step.token_ids) if self.suffix else out
        self.text.append(step.text)
        if step.token_ids:  # one event per token, even one with no text yet
            return self._delta_event(step)
        return b""

    async def closing(self) -> bytes:
        assert self.finish is not None
        stop_reason, stop_sequence = stop_fields(self.finish)
        end: dict[str, Any] = {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": usage_body(self.finish.usage),
        }
        if self.context is not None:
            end["context_management"] = self.context
        stop = _BLOCK_STOP if self.blocks is None else self.blocks.end()
        if self.thread is not None:  # kept before message_stop: the next turn finds it
            await self.thread.answered(self.head()["id"], self.content())
        return stop + sse_event("message_delta", end) + _MESSAGE_STOP

    def failed(self, error: ApiError) -> bytes:
        return sse_event("error", anthropic_body(error, self.rid))

    # -- shared ----------------------------------------------------------------------------

    def content(self) -> list[dict[str, Any]]:
        """The answer's content blocks, once its output is all read."""
        if self.blocks is not None:
            return self.blocks.content()
        return [{"type": "text", "text": "".join(self.text)}]

    def head(self) -> dict[str, Any]:
        return {
            "id": "msg_" + self.rid.removeprefix("req_"),
            "type": "message",
            "role": "assistant",
            "model": self.model,
        }

    def _with_ids(self, out: bytes, token_ids: list[int]) -> bytes:
        """`return_token_ids` with content blocks: the step's token ids in its last event
        (each event's data is one JSON object), or a ping that carries them."""
        if not token_ids:
            return out
        ids = b',"token_ids":' + orjson.dumps(token_ids) + b"}\n\n"
        if not out:
            return b'event: ping\ndata: {"type":"ping"' + ids
        return out[: -len(b"}\n\n")] + ids

    def _delta_event(self, step: Step) -> bytes:
        text = orjson.dumps(step.text)
        if self.suffix is None:
            return _DELTA_PREFIX + text + _DELTA_SUFFIX
        return _DELTA_PREFIX + text + self.suffix + orjson.dumps(step.token_ids) + b"}\n\n"
