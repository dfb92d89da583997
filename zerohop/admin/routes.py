"""The admin API's routes (docs/admin-api.md) over raw ASGI: who may call them, and how.

A request is authenticated by an admin key in `x-api-key` or `Authorization: Bearer`, or by
a console session cookie; with the cookie, every method but GET must carry the session's
CSRF token in `x-csrf-token`, and a cross-site `Origin` is refused. Errors are Anthropic's
error JSON. The routes never touch the engine. A request refused for who sent it (no key or
a bad one, not an admin key, a wrong CSRF token, a cross-site request, a dead session) is
audited (`zerohop.admin.refusal_audit`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import orjson

from zerohop.admin import views
from zerohop.admin.context import AdminContext, AdminError, AdminRequest, invalid
from zerohop.admin.origin import cross_site
from zerohop.admin.refusal_audit import audit_error
from zerohop.admin.sessions import SessionsUnavailable, session_cookie
from zerohop.api.errors import ApiError
from zerohop.api.http.asgi import (
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    api_key,
    header,
    read_body,
    send_json,
)
from zerohop.gateway.keys.identity import Identity

log = logging.getLogger(__name__)

PREFIXES = ("/v1/organizations/", "/v1/admin/")
MAX_BODY = 64 * 1024
SAFE_METHODS = ("GET", "HEAD")


Handler = Callable[[AdminContext, AdminRequest], Awaitable[tuple[int, Any]]]
ROUTES: list[tuple[str, list[str], Handler]] = [
    (method, path.split("/"), handler) for method, path, handler in views.ROUTES
]


def is_admin_path(path: str) -> bool:
    return path.startswith(PREFIXES)


async def handle(scope: Scope, receive: Receive, send: Send, admin: AdminContext) -> None:
    try:
        handler, params = _route(scope["method"], scope["path"])
        identity = await _identity(scope, admin)
        request = AdminRequest(scope["method"], identity, _query(scope), params)
        if request.method not in SAFE_METHODS:
            request.body = await _json_body(scope, receive)
        status, body = await handler(admin, request)
    except AdminError as exc:
        audit_error(admin, scope, "admin", exc)
        return await send_json(send, exc.status, _error(exc.kind, exc.message))
    except ApiError as exc:  # the body: too large, too slow
        return await send_json(send, exc.status, _error("invalid_request_error", exc.message))
    except SessionsUnavailable:
        message = "the store that holds console sessions cannot be reached now; retry shortly"
        return await send_json(send, 503, _error("api_error", message))
    except ClientDisconnected:
        return
    except Exception:
        log.exception("admin %s %s failed", scope["method"], scope["path"])
        return await send_json(send, 500, _error("api_error", "internal server error"))
    await send_json(send, status, body, [(b"cache-control", b"no-store")])


def _route(method: str, path: str) -> tuple[Handler, dict[str, str]]:
    parts = path.rstrip("/").split("/")
    path_known = False
    for want_method, template, handler in ROUTES:
        params = _fill(template, parts)
        if params is None:
            continue
        if want_method == method:
            return handler, params
        path_known = True
    if path_known:
        raise AdminError(405, "invalid_request_error", f"{method} {path} is not supported")
    raise AdminError(404, "not_found_error", f"no such endpoint: {path}")


def _fill(template: list[str], parts: list[str]) -> dict[str, str] | None:
    if len(template) != len(parts):
        return None
    params = {}
    for want, got in zip(template, parts, strict=True):
        if want.startswith("{"):
            if not got:
                return None
            params[want.strip("{}")] = got
        elif want != got:
            return None
    return params


async def _identity(scope: Scope, admin: AdminContext) -> Identity:
    token = api_key(scope)
    if token is not None:
        return admin.admin_identity(token)
    cookie = session_cookie(scope["headers"])
    session = await admin.sessions.get(cookie)
    if session is None:
        if cookie is not None:  # expired, logged out or unknown: told so in the audit only
            raise AdminError(
                401, "authentication_error", "this route needs an admin key", reason="session"
            )
        return admin.admin_identity(None)  # 401: no key
    if scope["method"] not in SAFE_METHODS:
        csrf = header(scope, b"x-csrf-token")
        if not session.csrf_matches(csrf.decode("latin-1") if csrf else None):
            raise AdminError(
                403, "permission_error", "missing or wrong CSRF token", reason="csrf",
                key=admin.session_key(session),
            )  # fmt: skip
        if cross_site(scope):
            raise AdminError(
                403, "permission_error", "a cross-site request is refused",
                reason="cross_site", key=admin.session_key(session),
            )  # fmt: skip
    try:
        return admin.session_identity(session)
    except AdminError:  # revoked, expired, no longer an admin key: the session is over
        await admin.sessions.end(session.session_id)
        raise


def _query(scope: Scope) -> dict[str, list[str]]:
    return parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=False)


async def _json_body(scope: Scope, receive: Receive) -> dict[str, Any]:
    raw = await read_body(receive, MAX_BODY, encoding=header(scope, b"content-encoding"))
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise invalid("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def _error(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}
