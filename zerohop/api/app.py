"""The ASGI application: a small router over the Anthropic and OpenAI surfaces and health."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from zerohop.api import anthropic, openai
from zerohop.api.asgi import ClientDisconnected, Receive, Scope, Send, send_json
from zerohop.api.errors import ApiError, anthropic_body, openai_body
from zerohop.api.service import ServingContext, new_request_id

log = logging.getLogger(__name__)

Handler = Callable[[Scope, Receive, Send, str], Awaitable[None]]
ErrorShape = Callable[[ApiError, str], dict]
Routes = dict[tuple[str, str], tuple[Handler, ErrorShape]]

_HEALTHY = b'{"status":"ok"}'
_NOT_READY = b'{"status":"unavailable"}'


def create_app(ctx: ServingContext) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    routes: Routes = {
        **{k: (h, anthropic_body) for k, h in anthropic.routes(ctx).items()},
        **{k: (h, openai_body) for k, h in openai.routes(ctx).items()},
    }
    paths = {path for _, path in routes}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await _http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await _lifespan(receive, send)

    async def _http(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        # Health first and cheapest: it never touches the engine or the scheduler.
        if path == "/health":
            return await send_json(send, 200, None, raw=_HEALTHY)
        if path == "/ready":
            ok = ctx.ready
            return await send_json(
                send, 200 if ok else 503, None, raw=_HEALTHY if ok else _NOT_READY
            )
        if path == "/engine/stats" and scope["method"] == "GET":
            return await send_json(send, 200, await ctx.engine.stats())
        request_id = new_request_id()
        route = routes.get((scope["method"], path))
        if route is None:
            error, shape = _route_miss(scope["method"], path, path in paths)
            return await _send_error(send, error, shape, request_id)
        handler, shape = route
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await handler(scope, receive, tracking_send, request_id)
        except ClientDisconnected:
            return
        except ApiError as exc:
            if not started:
                await _send_error(send, exc, shape, request_id)
        except Exception:
            log.exception("request %s failed", request_id)
            if not started:
                await _send_error(send, ApiError(500, "internal server error"), shape, request_id)

    return app


def _route_miss(method: str, path: str, known_path: bool) -> tuple[ApiError, ErrorShape]:
    openai_path = path.startswith(("/v1/chat", "/v1/completions", "/v1/models"))
    shape = openai_body if openai_path else anthropic_body
    if known_path:
        return ApiError(405, f"{method} {path} is not supported"), shape
    if path.startswith("/v1/models/"):
        model = path.removeprefix("/v1/models/")
        return ApiError(404, f"The model `{model}` does not exist.", code="model_not_found"), shape
    return ApiError(404, f"no such endpoint: {path}"), shape


async def _send_error(send: Send, error: ApiError, shape: ErrorShape, request_id: str) -> None:
    ids = request_id.encode()
    await send_json(
        send, error.status, shape(error, request_id), [(b"request-id", ids), (b"x-request-id", ids)]
    )


async def _lifespan(receive: Receive, send: Send) -> None:
    # The engine is started before the server and stopped after it (see zerohop.server).
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
