"""The ASGI application: a small router over the Anthropic and OpenAI surfaces and health."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from zerohop.admin import routes as admin_routes
from zerohop.admin.context import AdminContext
from zerohop.api.anthropic import messages as anthropic
from zerohop.api.errors import ApiError, anthropic_body, error_kind, openai_body
from zerohop.api.http.asgi import (
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    api_key,
    client_address,
    send_json,
)
from zerohop.api.http.rate_headers import anthropic_rate_headers, openai_rate_headers
from zerohop.api.http.response_encoding import compress_responses
from zerohop.api.openai import chat as openai
from zerohop.api.responses import surface as responses
from zerohop.api.responses.websocket import ResponsesSocket, SocketLimits
from zerohop.api.serving import model_list
from zerohop.api.serving.service import ServingContext, api_error, new_request_id
from zerohop.app.services import Services
from zerohop.engine.base.errors import EngineDeadError
from zerohop.gateway.gateway import Call, GatewayError

log = logging.getLogger(__name__)

Handler = Callable[[Scope, Receive, Send, Call], Awaitable[None]]
ErrorShape = Callable[[ApiError, str], dict[str, Any]]
Routes = dict[tuple[str, str], tuple[Handler, ErrorShape]]
SURFACES: dict[ErrorShape, str] = {anthropic_body: "anthropic", openai_body: "openai"}
OPENAI_PATHS = (
    "/v1/chat",
    "/v1/completions",
    "/v1/responses",
    "/v1/models",
    "/v1/files",
    "/v1/batches",
)

_HEALTHY = b'{"status":"ok"}'
_READY = {"status": "ok"}
_NOT_READY = b'{"status":"unavailable"}'
_FAILED = b'{"status":"failed"}'


def create_app(
    ctx: ServingContext, services: Services | None = None, socket_limits: SocketLimits | None = None
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    services = services or Services()
    admin, batches = services.admin, services.batches
    routes: Routes = {
        **{k: (h, anthropic_body) for k, h in anthropic.routes(ctx, services.threads).items()},
        **{k: (h, openai_body) for k, h in openai.routes(ctx).items()},
        **{k: (h, openai_body) for k, h in responses.routes(ctx, services.responses).items()},
        **{k: (h, openai_body) for k, h in model_list.routes(ctx).items()},
    }
    if batches is not None:  # mounted only where a batch store runs
        from zerohop.batches import openai_routes
        from zerohop.batches import routes as batch_routes

        routes.update(
            {k: (h, anthropic_body) for k, h in batch_routes.anthropic(ctx, batches).items()}
        )
        routes.update({k: (h, openai_body) for k, h in openai_routes.openai(ctx, batches).items()})
    paths = {path for _, path in routes}
    templates = [(method, path.split("/")) for method, path in routes if "{" in path]

    surface = responses.ResponsesSurface(ctx, services.responses)
    socket = ResponsesSocket(ctx, surface, socket_limits)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await _http(scope, receive, compress_responses(scope, send))
        elif scope["type"] == "websocket":
            await _websocket(scope, receive, send)
        elif scope["type"] == "lifespan":
            await _lifespan(receive, send)

    async def _http(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        # Health first and cheapest: it never touches the engine or the scheduler. /health
        # is 200 while the process can serve or is recovering (an engine restart), 503 once
        # the engine cannot be restarted (the process then exits non-zero); /ready is 200
        # only while requests are served (see deploy/kubernetes/README.md).
        if path == "/health":
            ok = ctx.alive
            return await send_json(send, 200 if ok else 503, None, raw=_HEALTHY if ok else _FAILED)
        if path == "/ready":
            ok = ctx.ready
            return await send_json(
                send, 200 if ok else 503, _ready(ctx), raw=None if ok else _NOT_READY
            )
        if path == "/engine/stats" and scope["method"] == "GET":
            if ctx.metrics_token and api_key(scope) != ctx.metrics_token:
                return await send_json(send, 401, {"error": "this endpoint needs the metrics key"})
            try:
                return await send_json(send, 200, await ctx.engine.stats())
            except EngineDeadError:
                return await send_json(send, 503, None, raw=_NOT_READY)
        if path == "/metrics" and scope["method"] == "GET":
            return await _metrics(scope, send)
        request_id = new_request_id()
        if sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > ctx.max_header_bytes:
            error = ApiError(431, f"request headers are larger than {ctx.max_header_bytes} bytes")
            _, shape = _route_miss(scope["method"], path, True)
            return await _send_error(send, error, shape, request_id)
        if admin is not None and (admin_routes.is_admin_path(path) or _console(path)):
            return await _operator(scope, receive, send, admin)
        key = (scope["method"], path)
        if key not in routes and templates:
            key = _match(templates, scope, key)
        if key not in routes:
            key = _model_id_path(scope, key)
        route = routes.get(key)
        if route is None:
            known = key[1] in paths or _match(templates, scope, ("", path)) != ("", path)
            error, shape = _route_miss(scope["method"], path, known)
            return await _send_error(send, error, shape, request_id)
        handler, shape = route
        if path.startswith("/v1/models") and model_list.wants_anthropic(scope):
            shape = anthropic_body  # the anthropic SDKs' models.list/retrieve (model_list.py)
        client = client_address(scope)
        call = Call(request_id, SURFACES[shape], client, scope.get("http_version"))
        front = ctx.trusted_front.end_user(scope.get("client"), scope["headers"])
        call.end_user, call.end_user_email = front.user, front.email
        await _handle(scope, receive, send, handler, shape, call)

    async def _websocket(scope: Scope, receive: Receive, send: Send) -> None:
        """WebSocket mode of the Responses API; any other path's upgrade is a 404."""
        if scope["path"] == responses.BASE:
            return await socket(scope, receive, send)
        await receive()  # websocket.connect
        error = ApiError(404, f"no such WebSocket endpoint: {scope['path']}")
        body = orjson.dumps(openai_body(error, new_request_id()))
        headers = [(b"content-type", b"application/json")]
        await send({"type": "websocket.http.response.start", "status": 404, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})

    async def _operator(scope: Scope, receive: Receive, send: Send, admin: AdminContext) -> None:
        """The admin API and the console (zerohop.admin, zerohop.console)."""
        if _console(scope["path"]):
            from zerohop.console.routes import handle

            return await handle(scope, receive, send, admin)
        await admin_routes.handle(scope, receive, send, admin)

    async def run_line(scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        """A batch line through the route an HTTP request to its path takes, as the identity
        the runner set on `call` (no key to check): the same admission, charging and audit."""
        route = routes.get((scope["method"], scope["path"]))
        if route is None:
            error = ApiError(404, f"no such endpoint: {scope['path']}")
            return await _send_error(send, error, anthropic_body, call.request_id)
        handler, shape = route
        await _handle(scope, receive, send, handler, shape, call, authenticate=False)

    async def _handle(
        scope: Scope,
        receive: Receive,
        send: Send,
        handler: Handler,
        shape: ErrorShape,
        call: Call,
        authenticate: bool = True,
    ) -> None:
        gateway = ctx.gateway
        rate_headers = anthropic_rate_headers if shape is anthropic_body else openai_rate_headers
        status, error_type = 0, None

        async def tracking_send(message: dict[str, Any]) -> None:  # an ASGI message
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                extra = ctx.load_headers(call)
                if gateway is not None:
                    extra += rate_headers(gateway, call) + _clamp_header(call)
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        try:
            if gateway is not None and authenticate:
                gateway.authenticate(call, api_key(scope))
            await handler(scope, receive, tracking_send, call)
        except ClientDisconnected:  # 499 even where a stream had started: it was not finished
            status, error_type = 499, "client_disconnected"
        except (ApiError, GatewayError) as exc:
            error = api_error(exc) if isinstance(exc, GatewayError) else exc
            error_type = exc.reason if isinstance(exc, GatewayError) else error_kind(exc)
            call.refusal = exc.message  # kept where the request was refused
            if not status:
                await _send_error(tracking_send, error, shape, call.request_id)
        except Exception:
            log.exception("request %s failed", call.request_id)
            error_type = "internal"
            if not status:
                error = ApiError(500, "internal server error")
                await _send_error(tracking_send, error, shape, call.request_id)
        finally:
            if gateway is not None:
                gateway.finish(call, status or 499, error_type)

    async def _metrics(scope: Scope, send: Send) -> None:
        gateway = ctx.gateway
        if gateway is None or gateway.metrics is None:
            return await send_json(send, 404, {"error": "metrics are off"})
        if ctx.metrics_token and api_key(scope) != ctx.metrics_token:
            return await send_json(send, 401, {"error": "this endpoint needs the metrics key"})
        engine = ctx.engine
        stats = None
        with contextlib.suppress(EngineDeadError):  # it may die while it answers
            stats = None if engine.dead else (engine.latest_stats or await engine.stats())
        body, content_type = gateway.metrics.render(stats)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", content_type.encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    app.routes = routes  # type: ignore[attr-defined]  # what tests enumerate (auth on each)
    app.run_line = run_line  # type: ignore[attr-defined]  # the batch runner's way in
    app.socket = socket  # type: ignore[attr-defined]  # WebSocket mode's counters (metrics)
    return app


def _console(path: str) -> bool:
    return path == "/console" or path.startswith("/console/")


def _match(
    templates: list[tuple[str, list[str]]], scope: Scope, key: tuple[str, str]
) -> tuple[str, str]:
    """The route template (`/v1/messages/batches/{id}`) a path fills, its parameters put in
    `scope["path_params"]`; `key` itself when none does. An empty method matches any."""
    method, path = key
    parts = path.split("/")
    for template_method, template in templates:
        if (method and method != template_method) or len(template) != len(parts):
            continue
        params = {}
        for want, got in zip(template, parts, strict=True):
            if want.startswith("{"):
                if not got:
                    break
                params[want.strip("{}")] = got
            elif want != got:
                break
        else:
            scope["path_params"] = params
            return (template_method if method else "", "/".join(template))
    return key


def _model_id_path(scope: Scope, key: tuple[str, str]) -> tuple[str, str]:
    """`GET /v1/models/{id}` for an id with `/` in it (`org/model`), which no template fills."""
    method, path = key
    model_id = path.removeprefix("/v1/models/")
    if method != "GET" or model_id == path or not model_id:
        return key
    scope["path_params"] = {"model_id": model_id}
    return ("GET", model_list.MODEL_PATH)


def _route_miss(method: str, path: str, known_path: bool) -> tuple[ApiError, ErrorShape]:
    openai_path = path.startswith(OPENAI_PATHS)
    shape = openai_body if openai_path else anthropic_body
    if known_path:
        return ApiError(405, f"{method} {path} is not supported"), shape
    if path.startswith("/v1/models/"):
        model = path.removeprefix("/v1/models/")
        return ApiError(404, f"The model `{model}` does not exist.", code="model_not_found"), shape
    return ApiError(404, f"no such endpoint: {path}"), shape


async def _send_error(send: Send, error: ApiError, shape: ErrorShape, request_id: str) -> None:
    ids = request_id.encode()
    headers = [(b"request-id", ids), (b"x-request-id", ids), *(error.headers or ())]
    await send_json(send, error.status, shape(error, request_id), headers)


def _ready(ctx: ServingContext) -> dict[str, Any]:
    """/ready's body while ready; a fleet replica that started while its store was down
    says it serves the keys of its local snapshot, and how old they are (ready all the same:
    it can serve)."""
    local = ctx.gateway.auth.snapshot_served if ctx.gateway is not None else None
    engine = ctx.engine.info.get("engine", "zerohop")
    body = _READY if engine == "zerohop" else {**_READY, "engine": engine}
    if local is None:
        return body
    return {**body, "keys": "snapshot", "snapshot_age_seconds": round(local.age() or 0, 1)}


def _clamp_header(call: Call) -> list[tuple[bytes, bytes]]:
    reservation = call.reservation
    if reservation is None or not reservation.clamped:
        return []
    return [(b"x-zerohop-max-tokens-clamped", str(reservation.max_tokens).encode())]


async def _lifespan(receive: Receive, send: Send) -> None:
    # The engine is started before the server and stopped after it (see zerohop.app.server).
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
