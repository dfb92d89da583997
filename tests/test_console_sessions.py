"""Console sessions across real `zerohop serve` processes, on the tiny model: a session made
on one server is served by another on the same SQLite keys.db after the first stopped (a
restart), and by another replica of a real PostgreSQL fleet store; a logout on one replica
ends it on the other; an idle or expired session is refused. The cookie is Secure through a
TLS-terminating proxy the server trusts (X-Forwarded-Proto: https from --forwarded-allow-ips)
and with --secure-cookies, and not when the header comes from a peer it does not trust. In
Chromium, a session keeps working while its pages alternate between two replicas and across
a restart of one of them."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser import ConsoleTab, launch_browser
from tests.live_server import LiveServer
from tests.pg_fixtures import sql, wait_until
from zerohop.admin.sessions import COOKIE, session_digest
from zerohop.gateway.store.sqlite import KeyStore

TIMEOUT = 30.0
HTTPS = {"x-forwarded-proto": "https"}
TENANTS = "#keys-table tbody tr[data-key]"  # the tenants page, once its admin API data is in


# -- helpers ------------------------------------------------------------------------------------


def login(server: LiveServer, key: str, headers: dict[str, str] | None = None) -> httpx.Response:
    response = httpx.post(
        server.url + "/console/login", data={"key": key}, headers=headers, timeout=TIMEOUT
    )
    assert response.status_code == 303, response.text
    return response


def flags(response: httpx.Response) -> list[str]:
    return [part.strip() for part in response.headers["set-cookie"].split(";")]


def cookie_of(response: httpx.Response) -> dict[str, str]:
    match = re.match(rf"{COOKIE}=([^;]+);", response.headers["set-cookie"])
    assert match, response.headers["set-cookie"]
    return {"cookie": f"{COOKIE}={match.group(1)}"}


def page(server: LiveServer, cookie: dict[str, str]) -> httpx.Response:
    return httpx.get(server.url + "/console/overview", headers=cookie, timeout=TIMEOUT)


def csrf_on(server: LiveServer, cookie: dict[str, str]) -> str:
    """The session's CSRF token, from a page `server` serves it (a live session there)."""
    response = page(server, cookie)
    assert response.status_code == 200, (response.status_code, response.headers)
    match = re.search(r'<meta name="csrf-token" content="([^"]+)">', response.text)
    assert match, response.text
    return match.group(1)


def refused(server: LiveServer, cookie: dict[str, str]) -> bool:
    """The console sends this session's holder to the login page."""
    response = page(server, cookie)
    return response.status_code == 303 and response.headers["location"] == "/console/login"


def put_tenant(server: LiveServer, cookie: dict[str, str], csrf: str, name: str) -> int:
    """A change through the admin API, as the console's pages make it."""
    headers = {**cookie, "x-csrf-token": csrf, "content-type": "application/json"}
    url = f"{server.url}/v1/admin/tenants/{name}"
    return httpx.put(url, json={"weight": 2}, headers=headers, timeout=TIMEOUT).status_code


def digest(cookie: dict[str, str]) -> str:
    """What the store keys the session of that Cookie header by."""
    return session_digest(cookie["cookie"].removeprefix(f"{COOKIE}="))


def started(llama_dir: Path, folder: Path, args: list[str], env: dict[str, str] | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    return LiveServer(llama_dir, args, extra_env=env or {}).start(folder / "server.log")


# -- one keys.db, one server after another ------------------------------------------------------


def test_a_session_outlives_its_server_and_the_cookie_is_secure_only_over_https(
    llama_dir: Path, tmp_path: Path
) -> None:
    db = tmp_path / "keys.db"
    store = KeyStore(db)
    admin_key, _ = store.create_key("ops", name="root", admin=True, inference=False)
    store.close()

    # A peer it does not trust says https: believed not, the cookie is not Secure.
    first = started(llama_dir, tmp_path / "one", ["--keys-db", str(db),
                                                  "--forwarded-allow-ips", "10.9.8.7"])  # fmt: skip
    try:
        made = login(first, admin_key, HTTPS)
        assert "Secure" not in flags(made) and "HttpOnly" in flags(made)
        cookie = cookie_of(made)
        csrf = csrf_on(first, cookie)
    finally:
        first.stop()

    # A restart on the same files: the session goes on, with the same CSRF token.
    second = started(llama_dir, tmp_path / "two", ["--keys-db", str(db)])
    try:
        assert csrf_on(second, cookie) == csrf
        assert put_tenant(second, cookie, csrf, "made-after-restart") == 200
        assert put_tenant(second, cookie, "not-the-token", "forged") == 403
        plain = login(second, admin_key)
        assert "Secure" not in flags(plain)
        # The default --forwarded-allow-ips trusts this loopback peer: its https is believed.
        proxied = login(second, admin_key, HTTPS)
        assert "Secure" in flags(proxied)
        idle, expired = cookie_of(plain), cookie_of(proxied)
        assert not refused(second, idle) and not refused(second, expired)
        with closing(KeyStore(db)) as keys:  # a hand edit: one idle, one past its lifetime
            keys.conn.execute(
                "UPDATE console_sessions SET last_seen = last_seen - 7200"
                " WHERE session_sha256 = ?", (digest(idle),),
            )  # fmt: skip
            keys.conn.execute(
                "UPDATE console_sessions SET expires = ? WHERE session_sha256 = ?",
                (time.time() - 1, digest(expired)),
            )
        for gone in (idle, expired):
            response = page(second, gone)
            assert response.status_code == 303 and response.headers["location"] == "/console/login"
            assert "Max-Age=0" in response.headers["set-cookie"]  # the stale cookie cleared
        assert not refused(second, cookie)
    finally:
        second.stop()

    # The operator's word: Secure on plain HTTP too (and on the logout's clearing).
    third = started(llama_dir, tmp_path / "three", ["--keys-db", str(db), "--secure-cookies"])
    try:
        assert "Secure" in flags(login(third, admin_key))
        out = httpx.post(
            third.url + "/console/logout", data={"csrf": csrf}, headers=cookie, timeout=TIMEOUT
        )
        assert out.status_code == 303 and "Secure" in flags(out) and "Max-Age=0" in flags(out)
        assert refused(third, cookie)
    finally:
        third.stop()


def test_the_cookie_flags_are_validated_where_they_enter(llama_dir: Path) -> None:
    def serve(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "zerohop", "serve", str(llama_dir), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    bad = serve("--forwarded-allow-ips", "10.0.0.1,proxy.internal")
    assert bad.returncode == 2 and bad.stdout == ""
    assert "'proxy.internal' is not an IP address or a CIDR network" in bad.stderr
    host_bits = serve("--forwarded-allow-ips", "10.0.0.1/8")
    assert host_bits.returncode == 2 and "'10.0.0.1/8' is not" in host_bits.stderr
    no_console = serve("--no-gateway", "--secure-cookies")
    assert no_console.returncode == 1
    assert "--secure-cookies is for the console" in no_console.stderr
    assert "Traceback" not in bad.stderr + host_bits.stderr + no_console.stderr


# -- two replicas of one PostgreSQL fleet store -------------------------------------------------


@pytest.fixture(scope="module")
def fleet(
    llama_dir: Path, store_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[LiveServer]]:
    servers: list[LiveServer] = []
    try:
        for i in range(2):  # one after another: two model loads at once only share the cores
            folder = tmp_path_factory.mktemp(f"replica{i}")
            servers.append(started(llama_dir, folder, [], {"ZEROHOP_STORE": store_url}))
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def fleet_admin_key(fleet: list[LiveServer], store_url: str) -> str:
    from zerohop.gateway.store.postgres import PostgresStore

    store = PostgresStore(store_url)
    try:
        key, _ = store.create_key("ops", name="root", admin=True, inference=False)
    finally:
        store.close()
    for server in fleet:  # each replica's key feed has it within a second or so
        wait_until(lambda s=server: _logs_in(s, key), TIMEOUT, 0.05)
    return key


def _logs_in(server: LiveServer, key: str) -> bool:
    response = httpx.post(server.url + "/console/login", data={"key": key}, timeout=TIMEOUT)
    return response.status_code == 303


def test_a_session_is_served_by_every_replica_and_a_logout_on_one_ends_it_on_all(
    fleet: list[LiveServer], fleet_admin_key: str, store_url: str
) -> None:
    one, two = fleet
    cookie = cookie_of(login(one, fleet_admin_key))
    csrf = csrf_on(one, cookie)
    for _ in range(3):  # alternating, as a load balancer spreads the requests
        assert csrf_on(two, cookie) == csrf and csrf_on(one, cookie) == csrf
    assert put_tenant(two, cookie, csrf, "made-on-two") == 200
    assert put_tenant(one, cookie, csrf, "made-on-one") == 200
    me = httpx.get(two.url + "/v1/admin/me", headers=cookie, timeout=TIMEOUT)
    assert me.status_code == 200 and me.json()["tenant"] == "ops"
    stored = sql(store_url, "SELECT session_sha256, revoked FROM console_sessions")
    assert (digest(cookie), None) in stored
    assert not any(cookie["cookie"].split("=", 1)[1] in repr(row) for row in stored)

    out = httpx.post(two.url + "/console/logout", data={"csrf": csrf}, headers=cookie,
                     timeout=TIMEOUT)  # fmt: skip
    assert out.status_code == 303 and "Max-Age=0" in flags(out)
    assert refused(one, cookie) and refused(two, cookie)
    api = httpx.get(one.url + "/v1/admin/me", headers=cookie, timeout=TIMEOUT)
    assert api.status_code == 401
    (revoked,) = sql(
        store_url, f"SELECT revoked FROM console_sessions WHERE session_sha256 = '{digest(cookie)}'"
    )
    assert revoked[0] is not None


def test_an_idle_or_expired_session_is_refused_by_every_replica(
    fleet: list[LiveServer], fleet_admin_key: str, store_url: str
) -> None:
    one, two = fleet
    idle = cookie_of(login(one, fleet_admin_key))
    expired = cookie_of(login(two, fleet_admin_key))
    assert not refused(two, idle) and not refused(one, expired)
    sql(store_url, "UPDATE console_sessions SET last_seen = last_seen - 7200"
                   f" WHERE session_sha256 = '{digest(idle)}'")  # fmt: skip
    sql(store_url, f"UPDATE console_sessions SET expires = {time.time() - 1}"
                   f" WHERE session_sha256 = '{digest(expired)}'")  # fmt: skip
    for server in fleet:
        assert refused(server, idle) and refused(server, expired)


# -- in Chromium --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from launch_browser()


def test_in_chromium_a_session_alternates_between_replicas_and_outlives_a_restart(
    browser: Any,
    fleet: list[LiveServer],
    fleet_admin_key: str,
    llama_dir: Path,
    store_url: str,
    tmp_path: Path,
) -> None:
    tab = ConsoleTab.open(browser)
    try:
        page = tab.page
        one, two = fleet
        page.goto(f"{one.url}/console/login")
        page.fill("#key", fleet_admin_key)
        with page.expect_response(lambda r: r.request.method == "POST") as response:
            page.click("#login-form button[type=submit]")
        page.wait_for_load_state()
        assert response.value.status == 303 and page.url == f"{one.url}/console/overview"
        # A browser sends a host's cookies to each of its ports: each replica is reached
        # as another load balancer's choice would reach it.
        for server in (two, one, two):
            page.goto(f"{server.url}/console/tenants")
            assert page.url == f"{server.url}/console/tenants", "sent to the login page"
            page.wait_for_selector(TENANTS)
        # A change made on one replica (the page's CSRF token with it), seen on the other.
        page.fill("#tenant-name", "browser-made")
        page.click("#tenant-form button[type=submit]")
        page.wait_for_selector('#tenants-table tr[data-tenant="browser-made"]')
        page.goto(f"{one.url}/console/tenants")
        page.wait_for_selector('#tenants-table tr[data-tenant="browser-made"]')

        one.stop()  # a restart (a rolling update): a new process, a new port
        fleet[0] = one = started(
            llama_dir, tmp_path / "restarted", [], {"ZEROHOP_STORE": store_url}
        )
        page.goto(f"{one.url}/console/tenants")
        assert page.url == f"{one.url}/console/tenants", "the restart ended the session"
        page.wait_for_selector(TENANTS)

        page.goto(f"{two.url}/console/overview")
        page.click("#logout")
        page.wait_for_url(f"{two.url}/console/login")
        page.goto(f"{one.url}/console/tenants")
        assert page.url == f"{one.url}/console/login", "the logout did not reach the other"
        assert tab.problems() == []
    finally:
        tab.close()
