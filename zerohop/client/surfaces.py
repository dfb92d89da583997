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
its turn belongs to the interrupted request.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import orjson

from zerohop import sse

RETRYABLE_ERROR_TYPES = {"api_error", "overloaded_error", "server_error"}


class UpstreamFailed(Exception):
    """The replica ended the stream without finishing the answer."""


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole SSE events (each ending in a blank line) from a byte stream (`zerohop.sse`)."""
    parser = sse.Parser()
    async for chunk in chunks:
        for event in parser.feed(chunk):
            yield event.raw + b"\n\n"


def event_data(event: bytes) -> bytes | None:
    """The `data:` field of one SSE event (None for comments and pings without data)."""
    lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


class Surface:
    """One request on one API surface; `feed` follows its stream across replicas."""

    def __init__(self, payload: dict[str, Any]) -> None:
        self.payload = payload
        self.streaming = bool(payload.get("stream"))
        self.token_ids: list[int] = []  # output tokens the caller has
        self.base = 0  # of them, those sent before the current replica took over
        self.started = False  # the caller has the stream's preamble
        self.resumed = False  # the current replica continues another's answer
        self.done = False
        self.delivered = False  # the caller has part of the answer's text

    @property
    def resumable(self) -> bool:
        """Whether another replica can take over: nothing of the answer sent yet, or its
        token ids known (a server without `return_token_ids` would make it start over).
        A continuation continues one answer: OpenAI's `n` > 1 choices resume only unsent."""
        if not self.delivered:
            return True
        single = self.payload.get("n") in (None, 1) and self.payload.get("thread") is None
        return bool(self.token_ids) and single

    def affinity_text(self) -> str:
        """What prefix affinity hashes: for chats, the system prompt and the first user turn
        (a conversation's opening, the same at every later turn, so a conversation stays on
        the replica that caches it); for plain prompts, the prompt."""
        raise NotImplementedError

    def first_body(self) -> dict[str, Any]:
        if not self.streaming:
            return self.payload
        return {**self.payload, "return_token_ids": True}

    def continuation(self) -> dict[str, Any] | None:
        """The request that continues the answer on another replica; None when nothing is
        left to generate (the caller then gets `finish()`)."""
        self.resumed, self.base = self.started, len(self.token_ids)
        if not self.token_ids:
            return self.first_body()
        body = {**self.first_body(), "continue_token_ids": self.token_ids}
        limit = self.limit_field()
        if limit is not None:
            left = int(body.get(limit) or self.default_limit()) - len(self.token_ids)
            if left < 1:
                return None
            body[limit] = left
        return body

    def limit_field(self) -> str | None:
        return "max_tokens"

    def default_limit(self) -> int:
        raise NotImplementedError

    def feed(self, event: bytes) -> bytes:
        """Follow one upstream event; return what the caller gets of it (maybe nothing).
        Raises UpstreamFailed for an error the next replica can do better on."""
        raise NotImplementedError

    def finish(self) -> bytes:
        """The stream's end, when the answer ran out of tokens exactly at a failover."""
        raise NotImplementedError

    def error_event(self, message: str) -> bytes:
        """The stream's end when no replica could go on with it (OpenAI's error chunk)."""
        error = {"error": {"message": message, "type": "server_error", "code": "overloaded"}}
        return b"data: " + orjson.dumps(error) + b"\n\ndata: [DONE]\n\n"


class Messages(Surface):
    """Anthropic `POST /v1/messages`."""

    def __init__(self, payload: dict[str, Any]) -> None:
        super().__init__(payload)
        self.first_usage: dict[str, int] = {}
        self.open_block: int | None = None  # the index of the block the caller has open

    def affinity_text(self) -> str:
        system = text_of(self.payload.get("system") or "")
        return opening(system, _list(self.payload, "messages"))

    def default_limit(self) -> int:
        return int(self.payload["max_tokens"])

    def continuation(self) -> dict[str, Any] | None:
        if self.payload.get("thread") is not None:
            # Resumable only while nothing was delivered (`resumable`): the turn starts over,
            # since a thread's turn cannot be continued from token ids (threads.py).
            self.token_ids = []
        return super().continuation()

    def error_event(self, message: str) -> bytes:
        return sse_event("error", {"error": {"type": "overloaded_error", "message": message}})

    def feed(self, event: bytes) -> bytes:
        data = event_data(event)
        if data is None:
            return event
        message = orjson.loads(data)
        kind = message.get("type")
        if kind == "error":
            if message.get("error", {}).get("type") in RETRYABLE_ERROR_TYPES:
                raise UpstreamFailed(message["error"].get("message", "error event"))
            self.done = True
            return event
        self.token_ids.extend(message.get("token_ids", ()))
        if kind == "message_start":
            if self.resumed:
                return b""
            self.started = True
            self.first_usage = message["message"].get("usage", {})
        elif kind == "ping" and (self.resumed or "token_ids" in message):
            return event if self.payload.get("return_token_ids") else b""
        elif kind == "content_block_start":
            self.open_block = message.get("index")
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
        usage = {**self.first_usage, "output_tokens": len(self.token_ids)}
        end = {"delta": {"stop_reason": "max_tokens", "stop_sequence": None}, "usage": usage}
        index, self.open_block = self.open_block, None
        stop = b"" if index is None else sse_event("content_block_stop", {"index": index})
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
        return {
            **usage,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

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
        return opening("", _list(self.payload, "messages"))

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


class Responses(Surface):
    """OpenAI `POST /v1/responses`. Its affinity key is `prompt_cache_key` when the request
    has one (Codex sends its session's id: every turn of a session goes to one replica),
    else the conversation's opening. A stream resumes as the others do: the continuing
    replica builds the continued items without events and goes on in the open one; its
    `response.created` / `in_progress` and the item it reopens are dropped here, and its
    events renamed to the first replica's ids (response, items, calls) and numbered on from
    the caller's last `sequence_number`. A replica that fails once the caller has all
    `max_output_tokens` leaves nothing to continue: `finish` ends the stream with the
    response as the caller has it (its items; its usage: the input's, which a replica's
    `response.created` carries under `return_token_ids`, and the output tokens)."""

    ENDS = ("response.completed", "response.incomplete", "response.failed")
    PREAMBLE = ("response.created", "response.in_progress")

    def __init__(self, payload: dict[str, Any]) -> None:
        super().__init__(payload)
        self.sequence = 0  # the next event's number, as the caller sees it
        self.response: dict[str, Any] = {}  # the first replica's response object
        self.ids: list[tuple[str, str | None]] = []  # each item's id and call_id, by index
        self.reopened = 0  # the items the caller has when the current replica took over
        self.items: list[dict[str, Any]] = []  # each item as the caller last saw it
        self.closed = 0  # of them, those whose output_item.done the caller has (in order)
        self.input_usage: dict[str, Any] = {}  # response.created's (with return_token_ids)

    def affinity_text(self) -> str:
        key = self.payload.get("prompt_cache_key")
        if isinstance(key, str) and key:  # hashed: under one affinity block, never cut
            return "prompt_cache_key:" + hashlib.sha256(key.encode()).hexdigest()[:40]
        given = self.payload.get("input")
        items = (
            [{"role": "user", "content": given}]
            if isinstance(given, str)
            else _list(self.payload, "input")
        )
        return opening(text_of(self.payload.get("instructions") or ""), items)

    def limit_field(self) -> str | None:
        return "max_output_tokens" if self.payload.get("max_output_tokens") else None

    def continuation(self) -> dict[str, Any] | None:
        self.reopened = len(self.ids)
        return super().continuation()

    def feed(self, event: bytes) -> bytes:
        data = event_data(event)
        if data is None:
            return event
        message = orjson.loads(data)
        kind = message.get("type")
        if kind == "error" or kind in self.ENDS:
            self.done = True
        self.token_ids.extend(message.get("token_ids") or ())
        usage = message.get("usage")  # response.created's (return_token_ids), else None
        if not self.payload.get("return_token_ids"):
            message.pop("token_ids", None)
            message.pop("usage", None)
        if kind in self.PREAMBLE and self.resumed:
            return b""
        if kind == "response.created":
            self.started = True
            self.response = dict(message["response"])
            self.input_usage = usage or {}
        self.delivered |= isinstance(kind, str) and kind.endswith(".delta")
        if kind == "response.output_item.added":
            index = message["output_index"]
            if self.resumed and index < self.reopened:
                return b""  # the item the caller has open, reopened by the continuation
            item = message["item"]
            self.ids[index:] = [(item["id"], item.get("call_id"))]
        if self.resumed:
            self._rename(message)
        if kind in ("response.output_item.added", "response.output_item.done"):
            self._keep(message["output_index"], message["item"], kind.endswith(".done"))
        if "sequence_number" in message:
            message["sequence_number"] = self.sequence
            self.sequence += 1
        return sse_event(str(kind), message)

    def _rename(self, message: dict[str, Any]) -> None:
        """The continuing replica's ids made the first's, its usage counted once."""
        index = message.get("output_index")
        if isinstance(index, int) and index < len(self.ids):
            item_id, call_id = self.ids[index]
            if "item_id" in message:
                message["item_id"] = item_id
            if isinstance(message.get("item"), dict):
                message["item"] = _renamed(message["item"], item_id, call_id)
        response = message.get("response")
        if isinstance(response, dict):
            output = [
                _renamed(item, *self.ids[i]) if i < len(self.ids) else item
                for i, item in enumerate(response.get("output") or [])
            ]
            head = {k: self.response[k] for k in ("id", "created_at") if k in self.response}
            message["response"] = {**response, **head, "output": output}
            if response.get("usage"):
                message["response"]["usage"] = self._usage(response["usage"])

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        # The continuing replica counted the continued tokens as input.
        return {
            **usage,
            "input_tokens": usage["input_tokens"] - self.base,
            "output_tokens": usage["output_tokens"] + self.base,
        }

    def _keep(self, index: int, item: dict[str, Any], done: bool) -> None:
        self.items[index:] = [item]
        self.closed = index + 1 if done else index

    def finish(self) -> bytes:
        """The response as the caller has it: its items (one still open: `incomplete`), and
        usage from the input's (response.created's) and the output tokens it has."""
        output = [
            item if i < self.closed or "status" not in item else {**item, "status": "incomplete"}
            for i, item in enumerate(self.items)
        ]
        response = {**self.response, "status": "incomplete", "output": output}
        response["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.input_usage:
            tokens, usage = len(self.token_ids), self.input_usage
            total = usage["input_tokens"] + tokens
            response["usage"] = {**usage, "output_tokens": tokens, "total_tokens": total}
        event = {"response": response, "sequence_number": self.sequence}
        return sse_event("response.incomplete", event)

    def error_event(self, message: str) -> bytes:
        event = {"code": "overloaded", "message": message, "param": None}
        return sse_event("error", {**event, "sequence_number": self.sequence})


def _renamed(item: dict[str, Any], item_id: str, call_id: str | None) -> dict[str, Any]:
    item = {**item, "id": item_id}
    return item if call_id is None or "call_id" not in item else {**item, "call_id": call_id}


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


def opening(system: str, messages: list[dict[str, Any]]) -> str:
    """System text, then the messages up to and including the first user message."""
    parts = [system] if system else []
    for message in messages:
        parts.append(text_of(message.get("content")))
        if message.get("role") == "user":
            break
    return "\n".join(parts)


def _list(payload: dict[str, Any], name: str) -> list[dict[str, Any]]:
    value = payload.get(name)
    return [m for m in value if isinstance(m, dict)] if isinstance(value, list) else []


def text_of(content: Any) -> str:
    """A message's text: the string, or its text blocks joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict))
    return ""


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    """An Anthropic-style event: `event: NAME` and its data, whose `type` is NAME."""
    body = orjson.dumps({"type": name, **data})
    return b"event: " + name.encode() + b"\ndata: " + body + b"\n\n"
