"""What every API surface shares in the client: SSE events, and `Surface`, one request
followed across replicas (surfaces.py and responses_surface.py: each API's own rules).

A streamed answer is followed event by event: the token ids each event carries (the request
asks for `return_token_ids`), and whether the terminal event came. When the replica fails
mid-stream, `continuation` is the same request with `continue_token_ids` (the tokens the
caller already has) and `max_tokens` lowered by as many; the continuing replica's events are
then rewritten so the caller sees one stream.
"""

from __future__ import annotations

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


def cached_within(usage: dict[str, Any], details: str, tokens: int) -> dict[str, Any]:
    """`usage[details]` with its `cached_tokens` at most `tokens`: a continuing replica's
    prefix cache also held the continued tokens, which are not the caller's input."""
    given = usage.get(details)
    if not isinstance(given, dict) or not isinstance(given.get("cached_tokens"), int):
        return usage
    return {**usage, details: {**given, "cached_tokens": min(given["cached_tokens"], tokens)}}


def opening(system: str, messages: list[dict[str, Any]]) -> str:
    """System text, then the messages up to and including the first user message."""
    parts = [system] if system else []
    for message in messages:
        parts.append(text_of(message.get("content")))
        if message.get("role") == "user":
            break
    return "\n".join(parts)


def list_of(payload: dict[str, Any], name: str) -> list[dict[str, Any]]:
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
