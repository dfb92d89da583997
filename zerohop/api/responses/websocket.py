"""WebSocket mode on `/v1/responses` (what Codex, `responses.connect()` and the Agents SDK's
websocket transport open first).

The upgrade is authenticated with the key HTTP takes (`Authorization: Bearer`, `x-api-key`);
a refused one is answered as HTTP would answer it (401, 403, 503), with the API's error body,
and never upgraded. Then each `response.create` message is one request through the gateway
(its own request id, admission, rate limits, budget, audit record with `http_version`
"websocket", metrics) and runs the streamed `POST /v1/responses` path of the surface
(`ResponsesSurface.streamed`): every SSE event it writes goes out as one text message, its
JSON unchanged.

Lanes (`stream_id`, as OpenAI documents it): a `response.create` names the lane it runs on
(none: the socket's default lane). Messages on one lane are answered in order, one at a time;
lanes run side by side, each response its own gateway request, and every event of a
response whose create named a lane carries its `stream_id` (its `error` event too). At most
`SocketLimits.max_pending` responses wait or run on all lanes together; past that the socket
stops reading, as a full buffer does.

As OpenAI's WebSocket mode does, the socket keeps its last response (each lane's) in memory,
so the next `previous_response_id` naming one works with `store: false` too, from any lane
(a lane may fork from another's response; the `max_pending` lanes used last are kept); older
ones come from the store.
`generate: false` answers with the response and no output (Codex's warm-up),
`response.processed` (Codex's acknowledgement) is taken and ignored, `stream` is implied,
`background: true` is refused. An error is the API's `error` event with the HTTP status it
stands for (`status`; its headers, such as `retry-after`, in `error.headers` and `headers`),
and the socket stays open. Behind a trusted front (`--trusted-front`), the upgrade's
end-user headers name the end user of each response on the socket, as on HTTP.

The socket closes with 1000 after `idle_timeout` seconds with no message and no response
running (a long response is never cut), with 1001 when the server drains (after the
responses being written; those still waiting are dropped), and with 1009 past the message size
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
from zerohop.api.http.websocket import DRAIN, SocketLimits
from zerohop.api.responses.schema import decode_request
from zerohop.api.responses.stored import Found
from zerohop.api.responses.surface import ResponsesSurface
from zerohop.api.serving.service import ServingContext, api_error, new_request_id
from zerohop.gateway.gateway import Call, GatewayError

log = logging.getLogger(__name__)

__all__ = ["ResponsesSocket", "SocketLimits"]

TRANSPORT = "websocket"  # the audit record's `http_version` for a socket's responses
# Fields of the message that are not the create body's.
ENVELOPE = ("type", "stream_id", "generate", "stream")
GOING_AWAY, NORMAL = 1001, 1000


@dataclass(slots=True)
class _Inbox:
    """The client's messages, read ahead of the ones being answered; the socket's end."""

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
                self.wake()
            elif kind == "websocket.disconnect":
                self.closed.set()
                self.wake()
                return

    def wake(self) -> None:
        """Wake an idle socket (a full inbox wakes it anyway: its messages are being taken)."""
        with contextlib.suppress(asyncio.QueueFull):
            self.messages.put_nowait(None)

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
        self.served = 0  # response.create messages answered with a response stream

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

    def call(self, scope: Scope) -> Call:
        """A new gateway call for the socket: its client, and its end user where the upgrade
        came from a trusted front (api/http/trusted_front.py)."""
        call = Call(new_request_id(), "openai", client_address(scope), TRANSPORT)
        front = self.ctx.trusted_front.end_user(scope.get("client"), scope["headers"])
        call.end_user, call.end_user_email = front.user, front.email
        return call

    def _refusal(self, scope: Scope) -> tuple[ApiError, Call] | None:
        """Why the upgrade is refused (audited as HTTP refusals are), or None."""
        call = self.call(scope)
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


@dataclass(slots=True)
class _Lane:
    """One `stream_id`'s creates, answered in order by its task (alive while it has some)."""

    creates: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None


class _Session:
    """One open socket: its messages dispatched to their lanes, each lane's last response
    kept."""

    def __init__(self, owner: ResponsesSocket, scope: Scope, inbox: _Inbox, send: Send) -> None:
        self.owner, self.scope, self.inbox, self.send = owner, scope, inbox, send
        self.last: dict[str | None, Found] = {}  # by lane, the last used last
        self.lanes: dict[str | None, _Lane] = {}
        self.slots = asyncio.Semaphore(owner.limits.max_pending)
        self.running = 0  # creates waiting or running on the lanes
        self.quiet_since = asyncio.get_running_loop().time()  # the last message or response
        self.stopping = False  # the socket is closing: waiting creates are dropped

    async def run(self) -> tuple[int, str]:
        try:
            return await self._dispatch()
        finally:
            self.stopping = True
            tasks = [lane.task for lane in self.lanes.values() if lane.task]
            for failure in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(failure, Exception):
                    log.error("a WebSocket lane failed", exc_info=failure)

    async def _dispatch(self) -> tuple[int, str]:
        inbox, idle = self.inbox, self.owner.limits.idle_timeout
        while True:
            if inbox.draining:
                return GOING_AWAY, "the server is shutting down"
            if inbox.closed.is_set() or self.stopping:
                return NORMAL, ""
            try:
                data = await self._next(idle)
            except TimeoutError:
                return NORMAL, f"idle for {idle:g} seconds"
            if data is None:
                continue
            try:
                await self._take(data)
            except ClientDisconnected:
                return NORMAL, ""

    async def _next(self, idle: float) -> str | bytes | None:
        """The next message; TimeoutError once `idle` seconds passed with none and no
        response running (a response running keeps the socket open, however long)."""
        loop = asyncio.get_running_loop()
        while True:
            left = idle if self.running else self.quiet_since + idle - loop.time()
            try:
                async with asyncio.timeout(max(left, 0.0)):
                    data = await self.inbox.messages.get()
            except TimeoutError:
                if self.running or loop.time() < self.quiet_since + idle:
                    continue
                raise
            self.quiet_since = loop.time()
            return data

    async def _take(self, data: str | bytes) -> None:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return await self._error(ApiError(400, "The message is not valid JSON."))
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "response.create":
            return await self._queue(event)
        if kind == "response.processed":  # Codex's acknowledgement of a response: nothing to do
            return None
        shown = kind if isinstance(kind, str) else "(none)"
        message = f"Unknown event type '{shown}': this socket takes 'response.create'."
        await self._error(ApiError(400, message, param="type"))

    async def _queue(self, event: dict[str, Any]) -> None:
        """The create onto its lane (one started for it where none runs)."""
        lane_id = event.get("stream_id")
        if lane_id is not None and not isinstance(lane_id, str):
            error = ApiError(400, "stream_id must be a string.", param="stream_id")
            return await self._error(error)
        await self.slots.acquire()
        self.running += 1
        lane = self.lanes.get(lane_id)
        if lane is None:
            lane = self.lanes[lane_id] = _Lane()
            lane.task = asyncio.create_task(self._work(lane_id, lane))
        lane.creates.put_nowait(event)

    async def _work(self, lane_id: str | None, lane: _Lane) -> None:
        """A lane's creates, in order; the lane ends (and is forgotten) once it has none."""
        try:
            while not lane.creates.empty():
                event = lane.creates.get_nowait()
                try:
                    if not (self.stopping or self.inbox.draining or self.inbox.closed.is_set()):
                        await self._create(event, lane_id)
                except ClientDisconnected:
                    self.stopping = True
                finally:
                    self.running -= 1
                    self.quiet_since = asyncio.get_running_loop().time()
                    self.slots.release()
        finally:
            del self.lanes[lane_id]

    async def _create(self, event: dict[str, Any], lane_id: str | None) -> None:
        owner, gateway = self.owner, self.owner.ctx.gateway
        call = owner.call(self.scope)
        wire = _WireSend(self.send, owner, lane_id)
        error_type = None
        try:
            if gateway is not None:
                gateway.authenticate(call, api_key(self.scope))
            await self._run(event, call, wire, lane_id)
        except ClientDisconnected:
            wire.status, error_type = 499, "client_disconnected"
        except (ApiError, GatewayError) as exc:
            error = api_error(exc) if isinstance(exc, GatewayError) else exc
            error_type = exc.reason if isinstance(exc, GatewayError) else error_kind(exc)
            call.refusal = exc.message
            if not wire.status:
                wire.status = error.status
                await self._error(error, call.request_id, lane_id)
        except Exception:
            log.exception("request %s failed", call.request_id)
            error_type = "internal"
            if not wire.status:
                wire.status = 500
                await self._error(ApiError(500, "internal server error"), call.request_id, lane_id)
        finally:
            if gateway is not None:
                gateway.finish(call, wire.status or 499, error_type)

    async def _run(
        self, event: dict[str, Any], call: Call, wire: _WireSend, lane_id: str | None
    ) -> None:
        if event.get("background"):
            raise ApiError(
                400, "background is not supported in WebSocket mode.", param="background"
            )
        fields = {k: v for k, v in event.items() if k not in ENVELOPE}
        request = decode_request(orjson.dumps({**fields, "stream": True}))
        wanted = request.previous_response_id
        kept = next((f for f in self.last.values() if f.body["id"] == wanted), None)
        generate = event.get("generate") is not False
        encoder = await self.owner.surface.streamed(
            request, wire, call, self.inbox.gone, kept, generate
        )
        body = encoder.body
        self._keep(lane_id, Found(body["status"], body, encoder.ready.items))

    def _keep(self, lane_id: str | None, found: Found) -> None:
        """A lane's last response, kept for the next create; the socket keeps as many as it
        may have waiting (the lanes used longest ago are forgotten first)."""
        self.last.pop(lane_id, None)
        self.last[lane_id] = found
        while len(self.last) > self.owner.limits.max_pending:
            del self.last[next(iter(self.last))]

    async def _error(
        self, error: ApiError, request_id: str | None = None, lane_id: str | None = None
    ) -> None:
        """The API's `error` event; `status` says which HTTP status it stands for."""
        body = openai_body(error, request_id or new_request_id())
        event: dict[str, Any] = {"type": "error", "status": error.status, **body}
        if error.headers:  # where the SDK's type has them, and beside `status` as well
            headers = {k.decode(): v.decode() for k, v in error.headers}
            body["error"]["headers"] = event["headers"] = headers
        if lane_id is not None:
            event["stream_id"] = lane_id
        await _send_text(self.send, orjson.dumps(event))


class _WireSend:
    """The surface's ASGI HTTP `send` turned into WebSocket messages: each SSE event's data
    as one text message, with the lane's `stream_id` where the create named one (comments,
    the pings, are dropped: the protocol pings instead)."""

    def __init__(self, send: Send, owner: ResponsesSocket, lane_id: str | None) -> None:
        self.send, self.owner = send, owner
        self.status = 0  # 200 once the stream started
        # Spliced into each event's JSON object, right after its opening brace.
        self.tag = b"" if lane_id is None else b'"stream_id":' + orjson.dumps(lane_id) + b","

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            if self.status == 200:
                self.owner.served += 1  # counted before its events go out
            return
        for line in message.get("body", b"").split(b"\n"):
            if line.startswith(b"data: "):
                data = line[6:]
                if self.tag and data.startswith(b"{"):
                    data = b"{" + self.tag + data[1:]
                await _send_text(self.send, data)


async def _send_text(send: Send, data: bytes) -> None:
    try:
        await send({"type": "websocket.send", "text": data.decode()})
    except OSError as exc:  # uvicorn's ClientDisconnected: the socket is gone
        raise ClientDisconnected from exc
