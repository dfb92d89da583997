"""Console sessions in the key store (zerohop.admin.sessions over
zerohop.gateway.store.session_tables), in both stores, SQLite and a real PostgreSQL.

The admin API's session path through the real ASGI handler over a real key store: the cookie
authenticates reads; a change needs the session's CSRF token and a same-site Origin; a session
dies with its admin key; the store unreachable is a 503. The session store itself: a session
made through one store object is served and ended through another on the same store (two
replicas, or a restart); sessions expire when idle or old, `last_seen` is written at most every
`touch_every` seconds, the table stays bounded per key and in all, and it holds neither the
session id nor the CSRF token."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.live_server import free_port
from zerohop.admin import routes, sessions
from zerohop.admin.context import AdminContext
from zerohop.admin.service import AdminService
from zerohop.admin.sessions import COOKIE, SessionStore, secure_cookie
from zerohop.console import routes as console_routes
from zerohop.gateway.gateway import Gateway
from zerohop.gateway.store.sqlite import KeyStore
from zerohop.gateway.store.store import Store


@pytest.fixture
def admin(tmp_path: Path):
    db = tmp_path / "keys.db"
    store = KeyStore(db)
    _, record = store.create_key("ops", admin=True, inference=False)
    gateway = Gateway.from_store(db)
    gateway.start()
    context = AdminContext(
        gateway, AdminService.of(gateway), sessions=SessionStore(gateway.store.sessions)
    )
    yield context, store, record.key_id
    gateway.auth.close()
    gateway.store.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Any]]:
    """Opens the same store again each call: one per "replica"."""
    opened: list[Any] = []
    if request.param == "sqlite":

        def open_one() -> Any:
            opened.append(KeyStore(tmp_path / "keys.db"))
            return opened[-1]
    else:
        from tests.pg_fixtures import migrated_database
        from zerohop.gateway.store.postgres import PostgresStore

        url = migrated_database(request.getfixturevalue("postgres"))

        def open_one() -> Any:
            opened.append(PostgresStore(url))
            return opened[-1]

    yield open_one
    for store in opened:
        store.close()


def replica(opener: Callable[[], Any], **options: Any) -> SessionStore:
    """The sessions of a replica (or a restarted one): a store of its own on the same data."""
    return SessionStore(Store(opener).sessions, **options)


def rows(opener: Callable[[], Any]) -> list[tuple[Any, ...]]:
    """The table as stored: (session_sha256, key_id, created, last_seen, expires, revoked)."""
    query = (
        "SELECT session_sha256, key_id, created, last_seen, expires, revoked"
        " FROM console_sessions ORDER BY created, session_sha256"
    )
    store = opener()
    if isinstance(store, KeyStore):
        return [tuple(r) for r in store.conn.execute(query)]
    from tests.pg_fixtures import sql

    return sql(store.url, query)


def run(awaitable: Any) -> Any:
    return asyncio.run(awaitable)


def call(context: AdminContext, method: str, path: str, headers: dict[str, str],
         body: dict | None = None) -> tuple[int, dict]:  # fmt: skip
    scope = {"type": "http", "method": method, "path": path, "query_string": b"",
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}  # fmt: skip
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": orjson.dumps(body or {}), "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    run(routes.handle(scope, receive, send, context))
    return sent[0]["status"], orjson.loads(sent[1]["body"])


def cookie(session) -> dict[str, str]:
    return {"cookie": f"other=1; {COOKIE}={session.session_id}", "host": "127.0.0.1:8000"}


# -- the admin API's session path ---------------------------------------------------------------


def test_a_session_reads_but_changes_only_with_its_csrf_token_from_this_site(admin):
    context, _, key_id = admin
    session = run(context.sessions.create(key_id))
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
    too_long = {"cookie": f"{COOKIE}={'x' * 10_000}"}  # never looked up
    assert call(context, "GET", "/v1/admin/me", too_long)[0] == 401


def test_a_session_ends_when_its_admin_key_is_revoked(admin):
    context, store, key_id = admin
    session = run(context.sessions.create(key_id))
    assert call(context, "GET", "/v1/admin/me", cookie(session))[0] == 200
    store.revoke_key(key_id)
    context.gateway.auth.load()
    assert call(context, "GET", "/v1/admin/me", cookie(session))[0] == 401
    assert run(context.sessions.get(session.session_id)) is None  # ended in the store


def test_a_session_ends_when_its_key_stops_being_an_admin_key(admin):
    context, store, key_id = admin
    session = run(context.sessions.create(key_id))
    store.update_key(key_id, admin=False, inference=True)
    context.gateway.auth.load()
    status, body = call(context, "GET", "/v1/admin/me", cookie(session))
    assert (status, body["error"]["type"]) == (403, "permission_error")
    store.update_key(key_id, admin=True)  # an admin key again: the session stays over
    context.gateway.auth.load()
    assert call(context, "GET", "/v1/admin/me", cookie(session))[0] == 401


def test_sessions_the_store_cannot_reach_are_a_503_not_a_500(admin, tmp_path: Path):
    from zerohop.gateway.store.postgres import PostgresStore

    context, _, key_id = admin
    session = run(context.sessions.create(key_id))
    port = free_port()  # nothing listens there: the store is down
    down = Store(lambda: PostgresStore(f"postgresql://u@127.0.0.1:{port}/db"))
    context.sessions = SessionStore(down.sessions)
    status, body = call(context, "GET", "/v1/admin/me", cookie(session))
    assert (status, body["error"]["type"]) == (503, "api_error"), body
    assert "cannot be reached" in body["error"]["message"] and str(port) not in str(body)
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/console/overview", "query_string": b"",
             "headers": [(b"cookie", f"{COOKIE}={session.session_id}".encode())]}  # fmt: skip
    run(console_routes.handle(scope, receive, send, context))
    assert sent[0]["status"] == 503 and b"try again" in sent[1]["body"]


# -- the store ----------------------------------------------------------------------------------


def test_a_session_made_on_one_replica_is_served_and_ended_on_another(opener):
    one, two = replica(opener), replica(opener)
    made = run(one.create("zh-a"))
    seen = run(two.get(made.session_id))
    assert seen is not None and (seen.key_id, seen.csrf_token) == ("zh-a", made.csrf_token)
    assert seen.csrf_matches(made.csrf_token) and not seen.csrf_matches("zh-a")
    restarted = replica(opener)  # a restart: a new process on the same store
    assert run(restarted.get(made.session_id)) is not None
    run(two.end(made.session_id))  # logout on one replica ...
    assert run(restarted.get(made.session_id)) is None  # ... ends it on every other
    assert run(two.get(made.session_id)) is None
    ((digest, key_id, _, _, _, revoked),) = rows(opener)  # kept as a record of the logout
    assert digest == hashlib.sha256(made.session_id.encode()).hexdigest() and key_id == "zh-a"
    assert revoked is not None
    stored = repr(rows(opener))
    assert made.session_id not in stored and made.csrf_token not in stored
    run(two.end(made.session_id))  # again, and unknown or absent ids: nothing happens
    run(two.end("made-up"))
    run(two.end(None))
    assert run(two.get(None)) is None and run(two.get("")) is None


def test_sessions_expire_when_idle_or_old_and_stay_bounded(opener, monkeypatch):
    now = [1000.0]
    store = replica(opener, idle=10, lifetime=25, touch_every=1, clock=lambda: now[0])
    first = run(store.create("zh-a"))
    now[0] = 1009
    assert run(store.get(first.session_id)) is not None  # touched: idle counts from here
    now[0] = 1018
    assert run(store.get(first.session_id)) is not None
    now[0] = 1026
    assert run(store.get(first.session_id)) is None  # past its lifetime
    second = run(store.create("zh-a"))
    now[0] = 1037
    assert run(store.get(second.session_id)) is None  # idle too long
    third = run(store.create("zh-b"))  # purges both: one expired, one idle
    assert [r[1] for r in rows(opener)] == ["zh-b"]
    monkeypatch.setattr(sessions, "MAX_SESSIONS_PER_KEY", 3)
    made = []
    for _ in range(5):
        now[0] += 0.5
        made.append(run(store.create("zh-c")))
    assert [r[1] for r in rows(opener)] == ["zh-b", "zh-c", "zh-c", "zh-c"]
    assert run(store.get(made[1].session_id)) is None and run(store.get(made[2].session_id))
    assert run(store.get(third.session_id)) is not None  # another key's kept
    monkeypatch.setattr(sessions, "MAX_SESSIONS", 2)
    now[0] += 1
    assert run(store.get(made[-1].session_id)) is not None  # now the most recently seen
    now[0] += 0.5
    last = run(store.create("zh-d"))
    assert len(rows(opener)) == 2
    assert run(store.get(last.session_id)) is not None
    assert run(store.get(made[-1].session_id)) is not None  # the least recently seen went


def test_last_seen_is_written_at_most_every_touch_every_seconds(opener):
    now = [1000.0]
    store = replica(opener, idle=300, touch_every=60, clock=lambda: now[0])
    made = run(store.create("zh-a"))
    for t in (1010.0, 1030.0, 1059.0):
        now[0] = t
        assert run(store.get(made.session_id)) is not None
        assert rows(opener)[0][3] == 1000.0  # not written yet
    now[0] = 1061.0
    assert run(store.get(made.session_id)) is not None
    assert rows(opener)[0][3] == 1061.0
    now[0] = 1100.0
    run(store.get(made.session_id))
    assert rows(opener)[0][3] == 1061.0


def test_a_store_made_before_sessions_gets_the_table_on_open(tmp_path: Path) -> None:
    path = tmp_path / "keys.db"
    old = KeyStore(path)
    old.conn.execute("DROP TABLE console_sessions")
    old.close()
    opened = Store(lambda: KeyStore(path))
    store = SessionStore(opened.sessions)
    made = run(store.create("zh-a"))
    assert run(store.get(made.session_id)) is not None
    opened.close()


def test_the_postgresql_migration_adds_the_table_as_version_6(postgres: Any) -> None:
    from tests.pg_fixtures import migrated_database, sql
    from zerohop.gateway.store.pg_schema import MIN_READER, PG_MIGRATIONS

    assert 6 in dict(PG_MIGRATIONS) and MIN_READER[6] == 2
    versions = [version for version, _ in PG_MIGRATIONS]
    assert versions == sorted(versions)
    url = migrated_database(postgres)
    assert sql(url, "SELECT version, min_reader FROM zerohop_schema WHERE version = 6") == [(6, 2)]
    indexes = sql(url, "SELECT indexname FROM pg_indexes WHERE tablename = 'console_sessions'")
    assert {"console_sessions_pkey", "console_sessions_key"} <= {r[0] for r in indexes}


# -- the cookie ---------------------------------------------------------------------------------


def test_the_session_cookie_is_http_only_and_same_site_strict():
    store = SessionStore()
    session = run(store.create("zh-a"))
    name, value = sessions.cookie_header(session, secure=True, max_age=60)
    text = value.decode()
    assert name == b"set-cookie" and text.startswith(f"{COOKIE}={session.session_id};")
    for flag in ("HttpOnly", "SameSite=Strict", "Secure", "Path=/", "Max-Age=60"):
        assert flag in text
    cleared = sessions.cookie_header(None, secure=False, max_age=60)[1].decode()
    assert "Max-Age=0" in cleared and "Secure" not in cleared


def test_the_cookie_is_secure_over_https_or_when_the_operator_says_so():
    assert secure_cookie({"scheme": "https"}, always=False)
    assert not secure_cookie({"scheme": "http"}, always=False)
    assert not secure_cookie({}, always=False)
    assert secure_cookie({"scheme": "http"}, always=True)
