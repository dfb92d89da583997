"""Small raw-ASGI helpers: read a bounded body, send JSON, stream bytes, watch for disconnects.

No framework in the token path (DESIGN.md: raw ASGI costs 3 µs a request, Starlette 19).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from zerohop.api.errors import ApiError
from zerohop.api.http.content_encoding import decoder_for
from zerohop.gateway.gateway import Call

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
# A surface's route: the request and the gateway's record of it.
Handler = Callable[[Scope, Receive, Send, Call], Awaitable[None]]
Headers = Sequence[tuple[bytes, bytes]]

JSON_HEADERS: Headers = [(b"content-type", b"application/json")]
SSE_HEADERS: Headers = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class ClientDisconnected(Exception):
    """The client went away: before its body was read, or while its answer was generated
    (`ServingContext.generate`). Recorded as 499 on every surface."""


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def api_key(scope: Scope) -> str | None:
    """The key from `x-api-key` (Anthropic) or `Authorization: Bearer` (OpenAI, anthropic>=2)."""
    if key := header(scope, b"x-api-key"):
        return key.decode("latin-1").strip()
    auth = header(scope, b"authorization")
    if auth is None:
        return None
    scheme, _, token = auth.decode("latin-1").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def client_address(scope: Scope) -> str | None:
    """The peer as `host:port` (the audit's `client`), or None where the server gives none."""
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else None


@dataclass(slots=True, frozen=True)
class BodyDeadline:
    """How long a request body may take: `timeout` seconds, plus one second for every
    `min_rate` bytes received (Apache's mod_reqtimeout rule), so a large body sent at a
    reasonable rate always fits and a trickle is cut off."""

    timeout: float = 30.0
    min_rate: float = 4096.0  # bytes per second

    def seconds_for(self, received: int) -> float:
        return self.timeout + received / self.min_rate


DEFAULT_BODY_DEADLINE = BodyDeadline()


async def read_body(
    receive: Receive,
    limit: int,
    deadline: BodyDeadline = DEFAULT_BODY_DEADLINE,
    encoding: bytes | None = None,
) -> bytes:
    """The whole request body; ApiError 413 past `limit` bytes, 408 past the deadline.
    `encoding` is the request's `content-encoding`: the body is decoded as it arrives, its
    decoded size held to `limit` too (content_encoding.py)."""
    decoder = decoder_for(encoding, limit)
    chunks, size = [], 0
    started = time.monotonic()
    while True:
        left = started + deadline.seconds_for(size) - time.monotonic()
        try:
            async with asyncio.timeout(max(left, 0.0)):
                message = await receive()
        except TimeoutError:
            raise ApiError(
                408,
                f"the request body arrived too slowly ({size} bytes in"
                f" {time.monotonic() - started:.0f} s)",
                headers=[(b"connection", b"close")],
            ) from None
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body is larger than the limit of {limit} bytes")
        chunks.append(decoder.feed(chunk) if decoder else chunk)
        if not message.get("more_body", False):
            if decoder:
                chunks.append(decoder.finish())
            return b"".join(chunks)


def request_id_headers(request_id: str) -> Headers:
    ids = request_id.encode()
    return [(b"request-id", ids), (b"x-request-id", ids)]


def check_json_content_type(value: bytes | None) -> None:
    """JSON only (a missing header is read as JSON, as vLLM does); charset must be UTF-8."""
    if value is None:
        return
    mime, *params = value.split(b";")
    mime = mime.strip().lower()
    if mime != b"application/json" and not mime.endswith(b"+json"):
        shown = value.decode("latin-1")
        raise ApiError(415, f"content-type must be application/json, got '{shown}'")
    for param in params:
        key, _, value = param.partition(b"=")
        charset = value.strip(b' "').lower()
        if key.strip().lower() == b"charset" and charset not in (b"utf-8", b"utf8"):
            raise ApiError(415, "content-type charset must be utf-8")


async def read_json_body(
    scope: Scope, receive: Receive, limit: int, deadline: BodyDeadline = DEFAULT_BODY_DEADLINE
) -> bytes:
    """The body of a JSON request: content type checked, size (413) and time (408) bounded."""
    check_json_content_type(header(scope, b"content-type"))
    return await read_body(receive, limit, deadline, header(scope, b"content-encoding"))


async def send_json(
    send: Send, status: int, body: Any, headers: Headers = (), raw: bytes | None = None
) -> None:
    payload = raw if raw is not None else orjson.dumps(body)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*JSON_HEADERS, *headers, (b"content-length", str(len(payload)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": payload})


async def start_stream(send: Send, headers: Headers = ()) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [*SSE_HEADERS, *headers]})


async def send_chunk(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def end_stream(send: Send, data: bytes = b"") -> None:
    await send({"type": "http.response.body", "body": data, "more_body": False})


def on_disconnect(receive: Receive, callback: Callable[[], None]) -> asyncio.Task[None]:
    """Call `callback` when the client goes away; cancel the task once the response is done.

    `send()` to a departed client returns silently on every server: `http.disconnect`
    from `receive()` is the only signal, so every streaming response watches for it.
    """

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        callback()

    return asyncio.create_task(watch())
