"""The admin API's console-session path, through the real ASGI handler over a real key store:
the session cookie authenticates reads; a change needs the session's CSRF token and a
same-site Origin; a session dies with its admin key; sessions expire and stay bounded."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from zerohop.admin import routes, sessions
from zerohop.admin.context import AdminContext
from zerohop.admin.service import AdminService
from zerohop.admin.sessions import COOKIE, SessionStore
from zerohop.gateway.gateway import Gateway
from zerohop.gateway.store.sqlite import KeyStore


@pytest.fixture
def admin(tmp_path: Path):
    db = tmp_path / "keys.db"
    store = KeyStore(db)
    _, record = store.create_key("ops", admin=True, inference=False)
    gateway = Gateway.from_store(db)
    gateway.start()
    context = AdminContext(gateway, AdminService(gateway))
    yield context, store, record.key_id
    context.service.close()
    gateway.auth.close()


def call(context: AdminContext, method: str, path: str, headers: dict[str, str],
         body: dict | None = None) -> tuple[int, dict]:  # fmt: skip
    scope = {"type": "http", "method": method, "path": path, "query_string": b"",
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}  # fmt: skip
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": orjson.dumps(body or {}), "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(routes.handle(scope, receive, send, context))
    return sent[0]["status"], orjson.loads(sent[1]["body"])


def cookie(session) -> dict[str, str]:
    return {"cookie": f"other=1; {COOKIE}={session.session_id}", "host": "127.0.0.1:8000"}


def test_a_session_reads_but_changes_only_with_its_csrf_token_from_this_site(admin):
    context, _, key_id = admin
    session = context.sessions.create(key_id)
    assert call(context, "GET", "/v1/admin/me", cookie(session)) == (
        200, {"key_id": key_id, "tenant": "ops", "name": ""})  # fmt: skip
    put = "/v1/admin/tenants/t1"
    status, body = call(context, "PUT", put, cookie(session), {"weight": 2})
    assert (status, body["error"]["type"]) == (403, "permission_error")
    wrong = cookie(session) | {"x-csrf-token": "forged"}
    assert call(context, "PUT", put, wrong, {"weight": 2})[0] == 403
    scope_bytes = cookie(session) | {"x-csrf-token": "\u00e9t\u00e9"}  # not ASCII: 403, not 500
    assert call(context, "PUT", put, scope_bytes, {"weight": 2})[0] == 403
    token = cookie(session) | {"x-csrf-token": session.csrf_token}
    cross = token | {"origin": "https://evil.example"}
    assert call(context, "PUT", put, cross, {"weight": 2})[0] == 403
    same = token | {"origin": "http://127.0.0.1:8000"}
    assert call(context, "PUT", put, same, {"weight": 2})[0] == 200
    fetched = token | {"sec-fetch-site": "cross-site", "origin": "http://127.0.0.1:8000"}
    assert call(context, "PUT", put, fetched, {"weight": 2})[0] == 403  # the browser's word
    ours = token | {"sec-fetch-site": "same-origin", "origin": "null"}  # no-referrer pages
    assert call(context, "PUT", put, ours, {"weight": 2})[0] == 200
    assert call(context, "GET", "/v1/admin/me", {"cookie": f"{COOKIE}=made-up"})[0] == 401


def test_a_session_ends_when_its_admin_key_is_revoked(admin):
    context, store, key_id = admin
    session = context.sessions.create(key_id)
    assert call(context, "GET", "/v1/admin/me", cookie(session))[0] == 200
    store.revoke_key(key_id)
    context.gateway.auth.load()
    assert call(context, "GET", "/v1/admin/me", cookie(session))[0] == 401
    assert context.sessions.get(session.session_id) is None


def test_sessions_expire_when_idle_or_old_and_stay_bounded(monkeypatch):
    now = [0.0]
    store = SessionStore(idle=10, lifetime=25, clock=lambda: now[0])
    first = store.create("zh-a")
    now[0] = 9
    assert store.get(first.session_id) is first  # touched: idle counts from here
    now[0] = 18
    assert store.get(first.session_id) is first
    now[0] = 26
    assert store.get(first.session_id) is None  # past its lifetime
    second = store.create("zh-a")
    now[0] = 37
    assert store.get(second.session_id) is None  # idle too long
    monkeypatch.setattr(sessions, "MAX_SESSIONS", 3)
    made = [store.create("zh-b") for _ in range(5)]
    assert len(store) == 3 and store.get(made[0].session_id) is None
    assert not made[-1].csrf_matches(None) and made[-1].csrf_matches(made[-1].csrf_token)


def test_the_session_cookie_is_http_only_and_same_site_strict():
    session = SessionStore().create("zh-a")
    name, value = sessions.cookie_header(session, secure=True, max_age=60)
    text = value.decode()
    assert name == b"set-cookie" and text.startswith(f"{COOKIE}={session.session_id};")
    for flag in ("HttpOnly", "SameSite=Strict", "Secure", "Path=/", "Max-Age=60"):
        assert flag in text
    cleared = sessions.cookie_header(None, secure=False, max_age=60)[1].decode()
    assert "Max-Age=0" in cleared and "Secure" not in cleared
