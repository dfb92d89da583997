"""What the client reads of each API: the prompt (for affinity), and streams it can resume.

A streamed answer is followed event by event: the token ids each event carries (the request
asks for `return_token_ids`), and whether the terminal event came. When the replica fails
mid-stream, `continuation` is the same request with `continue_token_ids` (the tokens the
caller already has) and `max_tokens` lowered by as many; the continuing replica's events are
then rewritten so the caller sees one stream: its preamble (`message_start`, the role chunk)
is dropped, ids stay the first replica's, and usage counts every output token once.

Agent traffic (tools, thinking, output formats) resumes the same way. The continuing replica
reads the continued tokens' text first, through the same thought / call reader and grammar,
without sending events for it, so it numbers blocks and calls counting the continued ones:
a `tool_use` block (or a chat `tool_calls` entry) begun before the failover goes on at the
same index with more `input_json_delta` (argument) deltas, and the caller's SDK assembles
one call. The client renumbers nothing. Messages with content blocks carry each step's
token ids in its last event, or in a `ping` when the step wrote none (dropped here unless
the caller asked for `return_token_ids`). A Messages `thread` is not resumed mid-stream:
its turn belongs to the interrupted request (`Messages`). The Responses API's own rules:
responses_surface.py.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from zerohop.client.responses_surface import Responses
from zerohop.client.surface_base import (
    RETRYABLE_ERROR_TYPES,
    Surface,
    UpstreamFailed,
    cached_within,
    event_data,
    list_of,
    opening,
    sse_event,
    sse_events,
    text_of,
)

__all__ = [  # what the other client modules import from here
    "ChatCompletions",
    "Completions",
    "Messages",
    "Responses",
    "Surface",
    "UpstreamFailed",
    "event_data",
    "sse_event",
    "sse_events",
    "surface_for",
    "surface_kind",
    "text_of",
]


class Messages(Surface):
    """Anthropic `POST /v1/messages`.

    A `thread` turn is never resumed mid-answer (its turn is the interrupted request's:
    threads.py); it starts over on another replica only while the caller has none of it. So
    the first replica's `message_start` and block starts are held back until the answer's
    first content (pings pass): a turn that starts over is the caller's under the id it is
    kept under, the restarting replica's. (Carrying the first id over instead could clash in
    a shared store with a turn the first replica, cut off but alive, still finished.)"""

    THINKING = ("thinking", "redacted_thinking")

    def __init__(self, payload: dict[str, Any]) -> None:
        super().__init__(payload)
        self.first_usage: dict[str, int] = {}
        self.open_block: int | None = None  # the index of the block the caller has open
        self.next_block = 0  # the index the caller's next block would have
        self.answered = False  # the caller has a block other than a thought
        self.thread = payload.get("thread") is not None
        self.held: bytes | None = b"" if self.thread else None  # a thread's, until content

    @property
    def resumable(self) -> bool:
        return not self.started if self.thread else super().resumable

    def affinity_text(self) -> str:
        system = text_of(self.payload.get("system") or "")
        return opening(system, list_of(self.payload, "messages"))

    def default_limit(self) -> int:
        return int(self.payload["max_tokens"])

    def continuation(self) -> dict[str, Any] | None:
        if self.thread:  # it starts over (`resumable`): what was held is the failed replica's
            self.token_ids, self.held = [], b""
            self.open_block, self.next_block, self.answered = None, 0, False
        return super().continuation()

    def error_event(self, message: str) -> bytes:
        return sse_event("error", {"error": {"type": "overloaded_error", "message": message}})

    def feed(self, event: bytes) -> bytes:
        data = event_data(event)
        if data is None:
            return event
        message = orjson.loads(data)
        kind = message.get("type")
        if kind == "error" and message.get("error", {}).get("type") in RETRYABLE_ERROR_TYPES:
            raise UpstreamFailed(message["error"].get("message", "error event"))
        out = self._follow(kind, message, event)
        if self.held is None or kind == "ping":
            return out
        if kind in ("message_start", "content_block_start"):
            self.held += out
            return b""
        out, self.held, self.started = self.held + out, None, True
        return out

    def _follow(self, kind: Any, message: dict[str, Any], event: bytes) -> bytes:
        """What the caller gets of one event, as if nothing were held back."""
        if kind == "error":
            self.done = True
            return event
        self.token_ids.extend(message.get("token_ids", ()))
        if kind == "message_start":
            if self.resumed:
                return b""
            self.started = self.held is None
            self.first_usage = message["message"].get("usage", {})
        elif kind == "ping" and (self.resumed or "token_ids" in message):
            return event if self.payload.get("return_token_ids") else b""
        elif kind == "content_block_start":
            self.open_block = index = message.get("index")
            self.next_block = index + 1 if isinstance(index, int) else self.next_block
            block = message.get("content_block") or {}
            self.answered |= block.get("type") not in self.THINKING
        elif kind == "content_block_stop":
            self.open_block = None
        elif kind == "content_block_delta":
            self.delivered = True
        elif kind == "message_delta" and self.resumed:
            usage = message.get("usage", {})
            output = self.base + usage.get("output_tokens", 0)
            message["usage"] = {**usage, **self.first_usage, "output_tokens": output}
            return sse_event("message_delta", message)
        elif kind == "message_stop":
            self.done = True
        return event

    def finish(self) -> bytes:
        """The end the replica would have sent: the open block's stop, an empty text block
        when the caller has no block but a thought (as the server ends a thinking-only
        answer), then `message_delta` and `message_stop`."""
        usage = {**self.first_usage, "output_tokens": len(self.token_ids)}
        end = {"delta": {"stop_reason": "max_tokens", "stop_sequence": None}, "usage": usage}
        index, self.open_block = self.open_block, None
        stop = b"" if index is None else sse_event("content_block_stop", {"index": index})
        if not self.answered:
            text = {"index": self.next_block, "content_block": {"type": "text", "text": ""}}
            stop += sse_event("content_block_start", text)
            stop += sse_event("content_block_stop", {"index": self.next_block})
        return stop + sse_event("message_delta", end) + sse_event("message_stop", {})


class _OpenAI(Surface):
    """Shared by chat completions and completions: chunks, usage and `[DONE]`."""

    text_key = ""

    def __init__(self, payload: dict[str, Any]) -> None:
        super().__init__(payload)
        self.head: dict[str, Any] = {}  # the first replica's id, created and model

    def feed(self, event: bytes) -> bytes:
        data = event_data(event)
        if data is None:
            return event
        if data == b"[DONE]":
            self.done = True
            return event
        chunk = orjson.loads(data)
        if "error" in chunk:
            if chunk["error"].get("type") in RETRYABLE_ERROR_TYPES:
                raise UpstreamFailed(chunk["error"].get("message", "error chunk"))
            self.done = True
            return event
        choices = chunk.get("choices") or []
        for choice in choices:
            self.token_ids.extend(choice.get("token_ids") or ())
            self.delivered |= _has_output(choice)
        if not self.resumed:
            if not self.started:
                self.started = True
                self.head = {k: chunk.get(k) for k in ("id", "created", "model")}
            return event
        if any("role" in (c.get("delta") or {}) for c in choices):
            return b""  # the continuing replica's opening chunk
        if chunk.get("usage"):
            chunk["usage"] = self._usage(chunk["usage"])
        return b"data: " + orjson.dumps({**chunk, **self.head}) + b"\n\n"

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        prompt = usage["prompt_tokens"] - self.base  # it counted the continued tokens as prompt
        completion = self.base + usage["completion_tokens"]
        counted = {
            **usage,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        return cached_within(counted, "prompt_tokens_details", prompt)

    def finish(self) -> bytes:
        choice = {"index": 0, "finish_reason": "length", "logprobs": None, **self.empty_choice()}
        chunk = {**self.head, "object": self.object_name, "choices": [choice]}
        return b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n"

    object_name = ""

    def empty_choice(self) -> dict[str, Any]:
        raise NotImplementedError


class ChatCompletions(_OpenAI):
    object_name = "chat.completion.chunk"

    def affinity_text(self) -> str:
        return opening("", list_of(self.payload, "messages"))

    def limit_field(self) -> str | None:
        for name in ("max_completion_tokens", "max_tokens"):
            if self.payload.get(name) is not None:
                return name
        return None  # no limit: up to the context length, wherever it continues

    def empty_choice(self) -> dict[str, Any]:
        return {"delta": {}}


class Completions(_OpenAI):
    object_name = "text_completion"

    def affinity_text(self) -> str:
        prompt = self.payload.get("prompt")
        return prompt if isinstance(prompt, str) else json.dumps(prompt)

    def default_limit(self) -> int:
        return 16  # the API's default max_tokens

    def continuation(self) -> dict[str, Any] | None:
        body = super().continuation()
        return body if body is None or not self.token_ids else {**body, "echo": False}

    def empty_choice(self) -> dict[str, Any]:
        return {"text": ""}


SURFACES: dict[str, type[Surface]] = {
    "/v1/messages": Messages,
    "/v1/chat/completions": ChatCompletions,
    "/v1/completions": Completions,
    "/v1/responses": Responses,
}


def surface_kind(path: str) -> type[Surface] | None:
    """The API whose generation endpoint `path` is (a base URL's prefix allowed), if any."""
    path = path.rstrip("/")
    return next((k for suffix, k in SURFACES.items() if path.endswith(suffix)), None)


def surface_for(method: str, path: str, body: bytes) -> Surface | None:
    """The surface of a generation request, or None for anything else (forwarded as is)."""
    kind = surface_kind(path)
    if method != "POST" or kind is None:
        return None
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None  # the replica answers it with a proper 400
    return kind(payload) if isinstance(payload, dict) else None


def _has_output(choice: dict[str, Any]) -> bool:
    """Whether a chunk's choice gives the caller part of the answer: text, a thought or a
    tool call."""
    if choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls"))
