"""The console over HTTP: login, sessions, CSRF, the security headers, the static allow-list.

A real uvicorn server in this process runs `zerohop.console.routes.handle` over a real
AdminContext and Gateway on a real SQLite key store, which holds the sessions too (no model:
the pages are shells, the admin API they call is tested elsewhere). Plain httpx; raw
http.client where a path must reach the server unnormalized (`..`).
"""

from __future__ import annotations

import asyncio
import http.client
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from zerohop.admin.context import AdminContext
from zerohop.admin.sessions import COOKIE, SessionStore
from zerohop.api.http.asgi import Receive, Scope, Send, send_json
from zerohop.console.routes import handle
from zerohop.console.security import CONTENT_SECURITY_POLICY
from zerohop.gateway.gateway import Gateway
from zerohop.gateway.store.sqlite import KeyStore
from zerohop.gateway.store.store import Store

PAGES = ("overview", "tenants", "usage", "refusals", "audit")
SAFETY_TIMEOUT = 30.0


@dataclass
class Console:
    url: str
    port: int
    admin: AdminContext
    store: KeyStore
    admin_key: str
    admin_key_id: str
    data_key: str

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, follow_redirects=False, timeout=SAFETY_TIMEOUT)

    def reload_keys(self) -> None:
        self.admin.gateway.auth.load()


def console_app(admin: AdminContext):
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        if scope["path"] == "/console" or scope["path"].startswith("/console/"):
            return await handle(scope, receive, send, admin)
        await send_json(send, 404, {"error": "not the console"})

    return app


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    db = tmp_path_factory.mktemp("console") / "keys.db"
    store = KeyStore(db)
    admin_key, admin_record = store.create_key("ops", name="operator", admin=True, inference=False)
    data_key, _ = store.create_key("team-a", name="app")
    gateway = Gateway.from_store(db)
    gateway.auth.load()
    admin = AdminContext(gateway, sessions=SessionStore(gateway.store.sessions))
    config = uvicorn.Config(
        console_app(admin), host="127.0.0.1", port=0, lifespan="off", log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + SAFETY_TIMEOUT
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield Console(
        f"http://127.0.0.1:{port}", port, admin, store, admin_key, admin_record.key_id, data_key
    )
    server.should_exit = True
    thread.join(SAFETY_TIMEOUT)
    gateway.store.close()
    store.close()


# -- helpers ------------------------------------------------------------------------------------


def assert_secure(response: httpx.Response | http.client.HTTPResponse) -> None:
    """The headers every console response carries."""
    headers = response.headers
    assert headers["content-security-policy"] == CONTENT_SECURITY_POLICY, dict(headers)
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["referrer-policy"] == "no-referrer"
    assert headers["x-frame-options"] == "DENY"


def assert_page(response: httpx.Response, status: int = 200) -> None:
    assert response.status_code == status, response.text
    assert_secure(response)
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    assert response.headers["cache-control"] == "no-store"


def assert_no_inline_code(html: str) -> None:
    """Nothing the CSP would block: every script has a src, no <style>, no style= or on*=
    attributes, no javascript: URLs."""
    for attrs in re.findall(r"<script\b([^>]*)>", html, re.I):
        assert "src=" in attrs, f"inline script: <script{attrs}>"
    assert not re.search(r"<script\b[^>]*>\s*[^<\s]", html, re.I), "a script with a body"
    assert not re.search(r"<style\b", html, re.I), "a <style> element"
    assert not re.search(r"\sstyle\s*=", html, re.I), "a style= attribute"
    assert not re.search(r"\son[a-z]+\s*=", html, re.I), "an on*= handler attribute"
    assert "javascript:" not in html.lower()


def login(console: Console, key: str, **headers: str) -> httpx.Response:
    with console.client() as client:
        return client.post("/console/login", data={"key": key}, headers=headers)


def session_cookie_of(response: httpx.Response) -> str:
    cookie = response.headers["set-cookie"]
    match = re.match(rf"{COOKIE}=([^;]+);", cookie)
    assert match, cookie
    return match.group(1)


def logged_in(console: Console) -> tuple[dict[str, str], str]:
    """A fresh session: (the Cookie header, its CSRF token from the page)."""
    response = login(console, console.admin_key)
    assert response.status_code == 303, response.text
    cookies = {"cookie": f"{COOKIE}={session_cookie_of(response)}"}
    with console.client() as client:
        page = client.get("/console/overview", headers=cookies)
    assert_page(page)
    match = re.search(r'<meta name="csrf-token" content="([^"]+)">', page.text)
    assert match, page.text
    return cookies, match.group(1)


def raw_get(console: Console, path: str) -> http.client.HTTPResponse:
    """GET `path` exactly as written (httpx would normalize dot segments)."""
    conn = http.client.HTTPConnection("127.0.0.1", console.port, timeout=SAFETY_TIMEOUT)
    conn.request("GET", path)
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


# -- login --------------------------------------------------------------------------------------


def test_login_page(console: Console) -> None:
    with console.client() as client:
        response = client.get("/console/login")
    assert_page(response)
    assert '<form method="post" action="/console/login"' in response.text
    assert 'name="key"' in response.text and 'type="password"' in response.text
    assert_no_inline_code(response.text)


def test_console_root_and_pages_need_a_session(console: Console) -> None:
    with console.client() as client:
        root = client.get("/console")
        assert root.status_code == 303 and root.headers["location"] == "/console/overview"
        assert_secure(root)
        for page in PAGES:
            response = client.get(f"/console/{page}")
            assert response.status_code == 303, (page, response.text)
            assert response.headers["location"] == "/console/login"
            assert_secure(response)
            forged = client.get(f"/console/{page}", headers={"cookie": f"{COOKIE}=made-up"})
            assert forged.status_code == 303 and forged.headers["location"] == "/console/login"
            assert "Max-Age=0" in forged.headers["set-cookie"], "the stale cookie is not cleared"


def test_login_with_an_unknown_key_is_401(console: Console) -> None:
    response = login(console, "zh-not-a-real-key")
    assert_page(response, 401)
    assert "set-cookie" not in response.headers
    assert 'id="login-error"' in response.text and "invalid API key" in response.text
    empty = login(console, "")
    assert_page(empty, 401)
    assert "set-cookie" not in empty.headers


def test_login_with_a_data_plane_key_is_403(console: Console) -> None:
    response = login(console, console.data_key)
    assert_page(response, 403)
    assert "set-cookie" not in response.headers
    assert "is not an admin key" in response.text


def test_login_with_an_admin_key_sets_a_strict_httponly_cookie(console: Console) -> None:
    response = login(console, console.admin_key)
    assert response.status_code == 303, response.text
    assert response.headers["location"] == "/console/overview"
    assert_secure(response)
    cookie = response.headers["set-cookie"]
    flags = [part.strip() for part in cookie.split(";")]
    assert "HttpOnly" in flags and "SameSite=Strict" in flags and "Path=/" in flags, cookie
    assert f"Max-Age={int(console.admin.sessions.lifetime)}" in flags, cookie
    assert "Secure" not in flags  # plain HTTP here; AdminContext.secure_cookies under TLS
    assert console.admin_key not in cookie


def test_through_a_trusted_tls_proxy_the_cookie_is_secure(console: Console) -> None:
    # uvicorn believes X-Forwarded-Proto from 127.0.0.1 (its default forwarded_allow_ips).
    response = login(console, console.admin_key, **{"x-forwarded-proto": "https"})
    assert response.status_code == 303, response.text
    assert "Secure" in [part.strip() for part in response.headers["set-cookie"].split(";")]
    cookies = {"cookie": f"{COOKIE}={session_cookie_of(response)}"}
    with console.client() as client:
        page = client.get("/console/overview", headers=cookies)
        assert_page(page)
        csrf = re.search(r'<meta name="csrf-token" content="([^"]+)">', page.text)
        assert csrf, page.text
        done = client.post(
            "/console/logout", data={"csrf": csrf.group(1)},
            headers={**cookies, "x-forwarded-proto": "https"},
        )  # fmt: skip
        assert done.status_code == 303 and "Max-Age=0" in done.headers["set-cookie"]
        assert "Secure" in done.headers["set-cookie"]
        assert client.get("/console/overview", headers=cookies).status_code == 303


def test_a_session_lives_in_the_key_store_file(console: Console) -> None:
    cookies, _ = logged_in(console)
    session_id = cookies["cookie"].removeprefix(f"{COOKIE}=")
    other_store = Store(lambda: KeyStore(console.store.path))  # another process's, say
    other = SessionStore(other_store.sessions)
    try:
        seen = asyncio.run(other.get(session_id))
        assert seen is not None and seen.key_id == console.admin_key_id
        asyncio.run(other.end(session_id))
    finally:
        other_store.close()
    with console.client() as client:
        gone = client.get("/console/overview", headers=cookies)
    assert gone.status_code == 303 and gone.headers["location"] == "/console/login"


def test_every_page_renders_for_a_session(console: Console) -> None:
    cookies, csrf = logged_in(console)
    with console.client() as client:
        for page in PAGES:
            response = client.get(f"/console/{page}", headers=cookies)
            assert_page(response)
            html = response.text
            assert f'data-page="{page}"' in html
            assert console.admin_key_id in html and console.admin_key not in html
            assert f'<meta name="csrf-token" content="{csrf}">' in html
            assert '<form method="post" action="/console/logout"' in html
            assert_no_inline_code(html)
            # Everything a page loads is served, from here, with its type.
            for url in re.findall(r'(?:src|href)="(/console/static/[^"]+)"', html):
                asset = client.get(url)
                assert asset.status_code == 200, url
                assert asset.headers["content-type"].startswith(("text/javascript", "text/css"))
            assert not re.search(r'(?:src|href)="(?:https?:)?//', html), "loads from elsewhere"
            head = client.head(f"/console/{page}", headers=cookies)
            assert head.status_code == 200 and head.content == b""


def test_the_login_page_refuses_a_cross_site_post(console: Console) -> None:
    evil = login(console, console.admin_key, origin="https://evil.example")
    assert_page(evil, 403)
    assert "set-cookie" not in evil.headers
    other_port = login(console, console.admin_key, origin="http://127.0.0.1:1")
    assert other_port.status_code == 403
    null = login(console, console.admin_key, origin="null")
    assert null.status_code == 403
    fetch_site = login(console, console.admin_key, **{"sec-fetch-site": "cross-site"})
    assert fetch_site.status_code == 403
    sibling = login(console, console.admin_key, **{"sec-fetch-site": "same-site"})
    assert sibling.status_code == 403
    lying = login(
        console, console.admin_key, origin=console.url, **{"sec-fetch-site": "cross-site"}
    )
    assert lying.status_code == 403
    # A browser's own form POST under Referrer-Policy: no-referrer: Origin "null", and
    # Sec-Fetch-Site saying where it really came from.
    own_form = login(console, console.admin_key, origin="null", **{"sec-fetch-site": "same-origin"})
    assert own_form.status_code == 303
    same = login(
        console, console.admin_key, origin=console.url, **{"sec-fetch-site": "same-origin"}
    )
    assert same.status_code == 303


def test_login_needs_a_form_body(console: Console) -> None:
    with console.client() as client:
        response = client.post("/console/login", json={"key": console.admin_key})
        assert_page(response, 415)
        huge = client.post("/console/login", data={"key": "x" * 100_000})
        assert_page(huge, 413)


# -- logout and sessions ------------------------------------------------------------------------


def test_logout_needs_the_csrf_token(console: Console) -> None:
    cookies, csrf = logged_in(console)
    with console.client() as client:
        bare = client.post("/console/logout", headers=cookies, data={})
        assert_page(bare, 403)
        wrong = client.post("/console/logout", headers=cookies, data={"csrf": "not-it"})
        assert_page(wrong, 403)
        wrong_header = client.post("/console/logout", headers={**cookies, "x-csrf-token": "no"})
        assert_page(wrong_header, 403)
        cross = client.post(
            "/console/logout", headers={**cookies, "origin": "https://evil.example"},
            data={"csrf": csrf},
        )  # fmt: skip
        assert_page(cross, 403)
        assert client.get("/console/overview", headers=cookies).status_code == 200, "logged out"

        done = client.post("/console/logout", headers=cookies, data={"csrf": csrf})
        assert done.status_code == 303 and done.headers["location"] == "/console/login"
        assert_secure(done)
        assert "Max-Age=0" in done.headers["set-cookie"]
        after = client.get("/console/overview", headers=cookies)
        assert after.status_code == 303 and after.headers["location"] == "/console/login"

    cookies, csrf = logged_in(console)  # the header form of the token works too
    with console.client() as client:
        done = client.post("/console/logout", headers={**cookies, "x-csrf-token": csrf})
        assert done.status_code == 303
        assert client.get("/console/overview", headers=cookies).status_code == 303


def test_a_session_ends_when_its_key_stops_being_an_admin_key(console: Console) -> None:
    key, record = console.store.create_key("ops", name="temporary", admin=True)
    console.reload_keys()
    response = login(console, key)
    assert response.status_code == 303
    cookies = {"cookie": f"{COOKIE}={session_cookie_of(response)}"}
    with console.client() as client:
        assert client.get("/console/tenants", headers=cookies).status_code == 200
        assert client.get("/console/login", headers=cookies).status_code == 303  # logged in
        console.store.revoke_key(record.key_id)
        console.reload_keys()
        gone = client.get("/console/tenants", headers=cookies)
        assert gone.status_code == 303 and gone.headers["location"] == "/console/login"
        assert "Max-Age=0" in gone.headers["set-cookie"]
        assert client.get("/console/login", headers=cookies).status_code == 200
    assert login(console, key).status_code == 401


# -- other paths and the static files -----------------------------------------------------------


def test_unknown_paths_and_methods(console: Console) -> None:
    cookies, _ = logged_in(console)
    with console.client() as client:
        missing = client.get("/console/nothing-here", headers=cookies)
        assert_page(missing, 404)
        post = client.post("/console/overview", headers=cookies)
        assert_page(post, 405)
        assert post.headers["allow"] == "GET, HEAD"
        logout_get = client.get("/console/logout", headers=cookies)
        assert_page(logout_get, 405)
        assert client.put("/console/login").status_code == 405


def test_static_files_from_the_package_only(console: Console) -> None:
    static = Path(__file__).resolve().parent.parent / "zerohop" / "console" / "static"
    with console.client() as client:
        for name, kind in [
            ("console.js", "text/javascript; charset=utf-8"),
            ("console.css", "text/css; charset=utf-8"),
            ("vendor/uplot/uPlot.iife.min.js", "text/javascript; charset=utf-8"),
            ("vendor/uplot/uPlot.min.css", "text/css; charset=utf-8"),
            ("vendor/uplot/LICENSE", "text/plain; charset=utf-8"),
        ]:
            response = client.get(f"/console/static/{name}?v=anything")
            assert response.status_code == 200, name
            assert response.headers["content-type"] == kind
            assert response.headers["cache-control"] == "public, max-age=3600"
            assert response.content == (static / name).read_bytes()
            assert_secure(response)
        assert client.post("/console/static/console.js").status_code == 405
    for path in [
        "/console/static/../routes.py",
        "/console/static/%2e%2e/routes.py",
        "/console/static/vendor/uplot/../../../routes.py",
        "/console/static/..%2froutes.py",
        "/console/static/vendor/../console.js",
        "/console/static//console.js",
        "/console/static/./console.js",
        "/console/static/%2fetc%2fpasswd",
        "/console/static/vendor/uplot/",
        "/console/static/vendor",
        "/console/static/",
        "/console/static/templates/base.html",
        "/console/static/../templates/base.html",
        "/console/static/console.js%00.css",
        "/console/static/CONSOLE.JS",
    ]:
        response = raw_get(console, path)
        assert response.status == 404, path
        assert_secure(response)
