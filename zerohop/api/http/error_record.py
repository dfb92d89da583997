"""Every error a server sends, written down for the test suite (`ZEROHOP_ERROR_RECORD=PATH`).

With the variable set, the HTTP app and the gRPC server append one JSON line to PATH per
error they send: an HTTP response of status 400 or more (its whole body), a chunk of a 200
stream that carries an error event, and a gRPC call ending with a status other than OK (its
details, or for an exception no handler caught, the text grpc.aio sends for it; see
grpc_error_record). The suite checks that none carries a traceback, a file path or an
internal exception's text (tests/error_bodies.py). Without the variable nothing is wrapped:
serving pays nothing.

Line: {"pid", "surface": "http" | "grpc", "where": "POST /v1/messages" | gRPC method,
"status": HTTP status or gRPC code name, "body": text}.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson

ENV = "ZEROHOP_ERROR_RECORD"
_STREAM_ERROR_MARKS = (b'"error"', b"event: error")

Message = dict[str, Any]
App = Callable[[Message, Callable[..., Any], Callable[..., Any]], Awaitable[None]]


def record_path() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def write(path: Path, surface: str, where: str, status: int | str, body: str) -> None:
    """One line, in one O_APPEND write: servers of one suite share the file."""
    line = {"pid": os.getpid(), "surface": surface, "where": where, "status": status}
    data = orjson.dumps({**line, "body": body}) + b"\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    except OSError:
        # A disk that refuses writes (tests inject exactly that) must not cost the client
        # its response: the record is lost, the error still goes out.
        pass


def recording_app(app: App) -> App:
    """`app`, recording the errors it sends when ZEROHOP_ERROR_RECORD is set (else `app`)."""
    path = record_path()
    if path is None:
        return app

    async def recorded(
        scope: Message, receive: Callable[..., Any], send: Callable[..., Any]
    ) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        response = _Response(path, f"{scope['method']} {scope['path']}")

        async def watched(message: Message) -> None:
            response.saw(message)
            await send(message)

        try:
            await app(scope, receive, watched)
        finally:
            response.end()

    return recorded


class _Response:
    """What one HTTP response sends. Each record is written before the message it is about
    goes out, so a client that has seen an error finds it in the record."""

    def __init__(self, path: Path, where: str) -> None:
        self.path, self.where = path, where
        self.status = 0
        self.body: bytearray | None = None  # an error body not yet recorded

    def saw(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.body = bytearray() if self.status >= 400 else None
        elif message["type"] == "http.response.body":
            chunk = message.get("body", b"")
            if self.body is not None:
                self.body += chunk
                if not message.get("more_body", False):
                    self.end()
            elif any(mark in chunk for mark in _STREAM_ERROR_MARKS):
                self._write(chunk)

    def end(self) -> None:
        """Record the error body (what was sent of it, when the app stopped short)."""
        if self.body is not None:
            body, self.body = bytes(self.body), None
            self._write(body)

    def _write(self, body: bytes) -> None:
        write(self.path, "http", self.where, self.status, body.decode("utf-8", "replace"))
