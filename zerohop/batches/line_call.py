"""One batch line, run in-process through the handler an HTTP request to its endpoint takes:
a synthetic ASGI scope, a `receive` that yields the line's body and then waits for `stop`
(a disconnect: that is how cancel and shutdown abort a running line), and a `send` that
keeps the response."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from zerohop.api.http.asgi import Receive, Scope, Send
from zerohop.api.serving.service import new_request_id
from zerohop.gateway.gateway import Call
from zerohop.gateway.keys.identity import Identity

RunLine = Callable[[Scope, Receive, Send, Call], Awaitable[None]]


@dataclass(slots=True)
class Answer:
    status: int
    request_id: str
    body: Any  # the decoded JSON body, or None when it was not JSON
    headers: dict[bytes, bytes] = field(default_factory=dict)

    def stored(self) -> dict[str, Any]:
        return {"status_code": self.status, "request_id": self.request_id, "body": self.body}

    def header(self, name: bytes) -> str | None:
        value = self.headers.get(name)
        return None if value is None else value.decode("latin-1")


def line_call(identity: Identity, batch: tuple[str, str], surface: str = "anthropic") -> Call:
    """The Call of a line's run: its caller, the background class, its batch for the audit."""
    call = Call(new_request_id(), surface, client=f"batch:{batch[0]}", identity=identity)
    call.background, call.batch = True, batch
    return call


async def call_line(
    run_line: RunLine, call: Call, endpoint: str, params: str, stop: asyncio.Event
) -> Answer:
    scope = _scope(endpoint)
    status, headers, chunks = 0, {}, []
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": params.encode(), "more_body": False}
        await stop.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            headers.update(message.get("headers", ()))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await run_line(scope, receive, send, call)
    return Answer(status or 500, call.request_id, _json(b"".join(chunks)), headers)


def _scope(endpoint: str) -> Scope:
    return {
        "type": "http",
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": endpoint,
        "raw_path": endpoint.encode(),
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": None,
        "server": None,
    }


def _json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
