"""WebSocket mode on `/v1/responses` (what Codex, `responses.connect()` and the Agents SDK's
websocket transport open first).

The upgrade is authenticated with the key HTTP takes (`Authorization: Bearer`, `x-api-key`);
a refused one is answered as HTTP would answer it (401, 403, 503), with the API's error body,
and never upgraded. Then each `response.create` message is one request through the gateway
(its own request id, admission, rate limits, budget, audit record with `http_version`
"websocket", metrics) and runs the streamed `POST /v1/responses` path of the surface
(`ResponsesSurface.streamed`): every SSE event it writes goes out as one text message, its
JSON unchanged. Messages are taken one at a time, in order: a `response.create` sent while
one runs waits for it (at most `SocketLimits.max_pending` wait; past that the socket stops
reading, as a full buffer does).

As OpenAI's WebSocket mode does, the socket keeps its last response in memory, so the next
`previous_response_id` naming it works with `store: false` too; older ones come from the
store. `generate: false` answers with the response and no output (Codex's warm-up),
`response.processed` (Codex's acknowledgement) is taken and ignored, `stream` is implied,
`background: true` is refused. An error is the API's `error` event with the HTTP status it
stands for (`status`), and the socket stays open.

The socket closes with 1000 after `idle_timeout` seconds without a message, with 1001 when
the server drains (after the response being written), and with 1009 past the message size
limit (the HTTP body limit, enforced by the protocol: app/server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import orjson

from zerohop.api.errors import ApiError, error_kind, openai_body
from zerohop.api.http.asgi import (
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    api_key,
    client_address,
)
from zerohop.api.http.websocket import DRAIN
from zerohop.api.responses.schema import decode_request
from zerohop.api.responses.stored import Found
from zerohop.api.responses.surface import ResponsesSurface
from zerohop.api.serving.service import ServingContext, api_error, new_request_id
from zerohop.gateway.gateway import Call, GatewayError

log = logging.getLogger(__name__)

TRANSPORT = "websocket"  # the audit record's `http_version` for a socket's responses
# Fields of the message that are not the create body's.
ENVELOPE = ("type", "stream_id", "generate", "stream")
GOING_AWAY, NORMAL = 1001, 1000


@dataclass(slots=True, frozen=True)
class SocketLimits:
    idle_timeout: float = 900.0  # seconds without a client message before the socket closes
    max_pending: int = 16  # messages read ahead of the one being answered


@dataclass(slots=True)
class _Inbox:
    """The client's messages, read ahead of the one being answered; the socket's end."""

    receive: Receive
    messages: asyncio.Queue[str | bytes | None]
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    draining: bool = False

    async def pump(self) -> None:
        while True:
            message = await self.receive()
            kind = message["type"]
            if kind == "websocket.receive":
                text = message.get("text")
                await self.messages.put(text if text is not None else message.get("bytes", b""))
            elif kind == DRAIN:
                self.draining = True
                self.messages.put_nowait(None)  # wake an idle socket
            elif kind == "websocket.disconnect":
                self.closed.set()
                self.messages.put_nowait(None)
                return

    async def gone(self) -> dict[str, Any]:
        """The generation's `receive`: it returns once the client has gone."""
        await self.closed.wait()
        return {"type": "http.disconnect"}


class ResponsesSocket:
    """The ASGI `websocket` handler of `/v1/responses` (app/routes.py)."""

    def __init__(
        self, ctx: ServingContext, surface: ResponsesSurface, limits: SocketLimits | None = None
    ) -> None:
        self.ctx, self.surface, self.limits = ctx, surface, limits or SocketLimits()
        self.open = 0  # sockets open now
        self.served = 0  # response.create messages answered

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        if (refusal := self._refusal(scope)) is not None:
            return await _refuse(send, *refusal)
        await send({"type": "websocket.accept"})
        inbox = _Inbox(receive, asyncio.Queue(self.limits.max_pending))
        pump = asyncio.create_task(inbox.pump())
        self.open += 1
        try:
            code, reason = await _Session(self, scope, inbox, send).run()
            if not inbox.closed.is_set():
                with contextlib.suppress(OSError):  # gone meanwhile
                    await send({"type": "websocket.close", "code": code, "reason": reason})
        finally:
            self.open -= 1
            pump.cancel()

    def _refusal(self, scope: Scope) -> tuple[ApiError, Call] | None:
        """Why the upgrade is refused (audited as HTTP refusals are), or None."""
        call = Call(new_request_id(), "openai", client_address(scope), TRANSPORT)
        if not self.ctx.ready:
            return ApiError(503, "the server is not ready (draining or restarting)"), call
        gateway = self.ctx.gateway
        if gateway is None:
            return None
        try:
            gateway.authenticate(call, api_key(scope))
        except GatewayError as exc:
            call.refusal = exc.message
            gateway.finish(call, exc.status, exc.reason)
            return api_error(exc), call
        return None


async def _refuse(send: Send, error: ApiError, call: Call) -> None:
    """The upgrade answered with an HTTP error (ASGI's websocket denial response)."""
    body = orjson.dumps(openai_body(error, call.request_id))
    ids = call.request_id.encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"x-request-id", ids),
        *(error.headers or ()),
    ]
    await send(
        {"type": "websocket.http.response.start", "status": error.status, "headers": headers}
    )
    await send({"type": "websocket.http.response.body", "body": body})


class _Session:
    """One open socket: its messages answered in order, its last response kept."""

    def __init__(self, owner: ResponsesSocket, scope: Scope, inbox: _Inbox, send: Send) -> None:
        self.owner, self.scope, self.inbox, self.send = owner, scope, inbox, send
        self.last: Found | None = None

    async def run(self) -> tuple[int, str]:
        inbox, idle = self.inbox, self.owner.limits.idle_timeout
        while True:
            if inbox.draining:
                return GOING_AWAY, "the server is shutting down"
            if inbox.closed.is_set():
                return NORMAL, ""
            try:
                async with asyncio.timeout(idle):
                    data = await inbox.messages.get()
            except TimeoutError:
                return NORMAL, f"idle for {idle:g} seconds"
            if data is None:
                continue
            try:
                await self._answer(data)
            except ClientDisconnected:
                return NORMAL, ""

    async def _answer(self, data: str | bytes) -> None:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return await self._error(ApiError(400, "The message is not valid JSON."))
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "response.create":
            return await self._create(event)
        if kind == "response.processed":  # Codex's acknowledgement of a response: nothing to do
            return None
        shown = kind if isinstance(kind, str) else "(none)"
        message = f"Unknown event type '{shown}': this socket takes 'response.create'."
        await self._error(ApiError(400, message, param="type"))

    async def _create(self, event: dict[str, Any]) -> None:
        owner, gateway = self.owner, self.owner.ctx.gateway
        call = Call(new_request_id(), "openai", client_address(self.scope), TRANSPORT)
        wire = _WireSend(self.send)
        error_type = None
        try:
            if gateway is not None:
                gateway.authenticate(call, api_key(self.scope))
            await self._run(event, call, wire)
            owner.served += 1
        except ClientDisconnected:
            wire.status, error_type = 499, "client_disconnected"
        except (ApiError, GatewayError) as exc:
            error = api_error(exc) if isinstance(exc, GatewayError) else exc
            error_type = exc.reason if isinstance(exc, GatewayError) else error_kind(exc)
            call.refusal = exc.message
            if not wire.status:
                wire.status = error.status
                await self._error(error, call.request_id)
        except Exception:
            log.exception("request %s failed", call.request_id)
            error_type = "internal"
            if not wire.status:
                wire.status = 500
                await self._error(ApiError(500, "internal server error"), call.request_id)
        finally:
            if gateway is not None:
                gateway.finish(call, wire.status or 499, error_type)

    async def _run(self, event: dict[str, Any], call: Call, wire: _WireSend) -> None:
        if event.get("background"):
            raise ApiError(
                400, "background is not supported in WebSocket mode.", param="background"
            )
        fields = {k: v for k, v in event.items() if k not in ENVELOPE}
        request = decode_request(orjson.dumps({**fields, "stream": True}))
        last = self.last
        kept = last if last and last.body["id"] == request.previous_response_id else None
        generate = event.get("generate") is not False
        encoder = await self.owner.surface.streamed(
            request, wire, call, self.inbox.gone, kept, generate
        )
        body = encoder.body
        self.last = Found(body["status"], body, encoder.ready.items)

    async def _error(self, error: ApiError, request_id: str | None = None) -> None:
        """The API's `error` event; `status` says which HTTP status it stands for."""
        body = openai_body(error, request_id or new_request_id())
        event: dict[str, Any] = {"type": "error", "status": error.status, **body}
        if error.headers:
            event["headers"] = {k.decode(): v.decode() for k, v in error.headers}
        await _send_text(self.send, orjson.dumps(event))


class _WireSend:
    """The surface's ASGI HTTP `send` turned into WebSocket messages: each SSE event's data
    as one text message (comments, the pings, are dropped: the protocol pings instead)."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.status = 0  # 200 once the stream started

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            return
        for line in message.get("body", b"").split(b"\n"):
            if line.startswith(b"data: "):
                await _send_text(self.send, line[6:])


async def _send_text(send: Send, data: bytes) -> None:
    try:
        await send({"type": "websocket.send", "text": data.decode()})
    except OSError as exc:  # uvicorn's ClientDisconnected: the socket is gone
        raise ClientDisconnected from exc
