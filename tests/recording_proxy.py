"""A recording reverse proxy for tests that put a real client (Claude Code) in front of a live
server: each request is forwarded as sent and its response streamed back chunk by chunk
as it arrives (an SSE stream stays a stream), and both are kept whole in `exchanges`.

Why a proxy and not the server's own logs: the audit log keeps what the gateway understood,
not the bytes on the wire; a test of a client's protocol needs its exact headers and body
and the server's exact status and SSE framing. aiohttp (a zerohop dependency) serves and
forwards; it runs on its own event loop in a thread, so sync tests can use it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

import aiohttp
from aiohttp import web

# Hop-by-hop headers (RFC 9110 7.6.1) and those aiohttp sets itself on each leg.
_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host",
     "content-length", "proxy-connection", "accept-encoding", "content-encoding"}
)  # fmt: skip


@dataclass
class Exchange:
    """One request as the client sent it and the response as the server sent it."""

    method: str
    path: str
    request_headers: dict[str, str]  # names in lower case, as HTTP/2 spells them
    request_body: bytes
    started: float
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)
    response_body: bytes = b""
    seconds: float = 0.0

    def json_body(self) -> Any:
        """The request body as JSON (None when it is empty)."""
        return json.loads(self.request_body) if self.request_body else None

    @property
    def is_stream(self) -> bool:
        return self.response_headers.get("content-type", "").startswith("text/event-stream")

    def as_record(self) -> dict[str, Any]:
        """A JSON-able record (bodies as text) for a sample on disk."""
        record = asdict(self)
        record["request_body"] = self.request_body.decode(errors="replace")
        record["response_body"] = self.response_body.decode(errors="replace")
        return record


class BackgroundApp:
    """An aiohttp application served on 127.0.0.1 (port chosen by the OS) from its own event
    loop in a daemon thread, so sync tests can run it beside a subprocess client."""

    def __init__(self) -> None:
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    async def _start(self) -> None:
        app = web.Application(client_max_size=64 * 2**20)
        self.routes(app)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class RecordingProxy(BackgroundApp):
    """Forwards every request to `upstream` and keeps each exchange in `exchanges`."""

    def __init__(self, upstream: str) -> None:
        super().__init__()
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self._session: aiohttp.ClientSession | None = None

    def save(self, path: Path) -> None:
        """Write every exchange so far as JSON lines (for a person to read)."""
        lines = (json.dumps(e.as_record()) for e in self.exchanges)
        path.write_text("".join(line + "\n" for line in lines))

    def routes(self, app: web.Application) -> None:
        app.router.add_route("*", "/{tail:.*}", self._forward)

    async def _start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        await super()._start()

    async def _stop(self) -> None:
        await super()._stop()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        exchange = Exchange(
            request.method, request.path_qs, _lower(request.headers), body, time.time()
        )
        self.exchanges.append(exchange)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        assert self._session is not None
        async with self._session.request(
            request.method, self.upstream + request.path_qs, headers=headers, data=body
        ) as upstream:
            exchange.status = upstream.status
            exchange.response_headers = _lower(upstream.headers)
            response = web.StreamResponse(status=upstream.status)
            for name, value in upstream.headers.items():
                if name.lower() not in _HOP:
                    response.headers[name] = value
            await response.prepare(request)
            chunks = []
            async for chunk in upstream.content.iter_any():
                chunks.append(chunk)
                await response.write(chunk)
            exchange.response_body = b"".join(chunks)
            exchange.seconds = time.time() - exchange.started
            await response.write_eof()
            return response


def _lower(headers: Mapping[str, str]) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


@contextmanager
def recording(upstream: str) -> Iterator[RecordingProxy]:
    """A started proxy to `upstream`, stopped on exit."""
    proxy = RecordingProxy(upstream).start()
    try:
        yield proxy
    finally:
        proxy.stop()
