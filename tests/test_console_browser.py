"""The console in a real browser (Debian's chromium through Playwright, tests/browser.py)
against a real `zerohop serve` on the tiny model: log in, make a tenant and a key, see the
secret once, watch the overview and usage move as the official SDK uses the key, revoke it,
search and verify the audit log; data-plane keys and forged requests refused; the charts
drawn; no Content-Security-Policy violation anywhere.

Set ZEROHOP_SAVE_SCREENSHOT=1 to write docs/console-overview.png (the README's picture).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.browser import ConsoleTab, distinct_colours, launch_browser, pixels_near
from tests.live_server import MODEL_NAME, LiveServer
from tests.test_gateway_auth import cli_json, headers_for
from zerohop.admin.sessions import COOKIE
from zerohop.gateway.store.sqlite import KEY_ID_LENGTH

ROOT = Path(__file__).resolve().parent.parent
PAGES = {  # a page, and what shows once its data has arrived
    "overview": "#stat-requests:not(:text('–'))",
    "tenants": "#keys-table tbody tr[data-key]",
    "usage": "#budgets-table tbody tr[data-subject]",
    "refusals": "#refusals-table tbody tr",
    "audit": "#audit-table tbody tr[data-seq]",
}
BLUE, ORANGE, GREEN = (0x2F, 0x6F, 0xDE), (0xE6, 0x7E, 0x22), (0x27, 0xAE, 0x60)
CHARTS = {  # chart box -> the colours of its series (console.js), one of which must show
    "chart-throughput": (BLUE, GREEN),  # requests/s, output tokens/s
    "chart-queue": (BLUE, ORANGE),  # running, waiting (drawn over running when both are 0)
    "chart-cache": (BLUE, GREEN),  # KV cache use, prefix-cache hits
    "chart-latency": (BLUE, GREEN),  # TTFT, inter-token latency
}
MOVES_WITHIN_MS = 2000  # the overview polls every second, usage reaches the store in ~1 s
# What a refused request's navigation or fetch makes chromium log (the tests expect them).
REFUSED = ("status of 401", "status of 403")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    # Module-scoped: Playwright's sync API runs an event loop in this thread while it is
    # open, and every later test that calls asyncio.run would fail beside it.
    yield from launch_browser()


@pytest.fixture(scope="module")
def keys(browser: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    db = tmp_path_factory.mktemp("console_keys") / "keys.db"

    def create(*flags: str) -> str:
        return cli_json("keys", "create", "--keys-db", db, *flags)["key"]

    return {
        "db": db,
        "admin": create("--tenant", "ops", "--name", "root", "--admin"),
        "data": create("--tenant", "acme", "--name", "app", "--budget", "100000/month"),
    }


@pytest.fixture(scope="module")
def server(keys: dict, llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("console_server") / "server.log"
    srv = LiveServer(llama_dir, ["--keys-db", str(keys["db"])]).start(log)
    yield srv
    srv.stop()


@pytest.fixture
def tab(browser: Any) -> Iterator[ConsoleTab]:
    opened = ConsoleTab.open(browser)
    yield opened
    opened.close()


# -- helpers ------------------------------------------------------------------------------------


def log_in(page: Any, server: LiveServer, key: str) -> Any:
    """Submit the login form; the response to its POST."""
    page.goto(f"{server.url}/console/login")
    page.fill("#key", key)
    with page.expect_response(lambda r: r.request.method == "POST") as response:
        page.click("#login-form button[type=submit]")
    page.wait_for_load_state()
    return response.value


def send(server: LiveServer, key: str, n: int, max_tokens: int = 5) -> None:
    client = anthropic.Anthropic(api_key=key, base_url=server.url, max_retries=0)
    for _ in range(n):
        client.messages.create(
            model=MODEL_NAME, max_tokens=max_tokens,
            messages=[{"role": "user", "content": "hello there"}],
        )  # fmt: skip


def number(page: Any, selector: str) -> int:
    return int(page.text_content(selector).replace(",", ""))


def admin_get(server: LiveServer, keys: dict, path: str) -> Any:
    response = httpx.get(server.url + path, headers=headers_for(keys["admin"]), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


# -- the tests ----------------------------------------------------------------------------------


def test_login_holds_a_strict_httponly_session_and_every_page_loads_clean(
    tab: ConsoleTab, server: LiveServer, keys: dict, tmp_path: Path
) -> None:
    page = tab.page
    send(server, keys["data"], 1)
    page.goto(f"{server.url}/console/tenants")
    assert page.url == f"{server.url}/console/login"  # no session yet
    response = log_in(page, server, keys["admin"])
    assert response.status == 303
    assert page.url == f"{server.url}/console/overview"
    (cookie,) = [c for c in tab.context.cookies() if c["name"] == COOKIE]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict", cookie
    assert page.evaluate("document.cookie") == "", "the session cookie is readable by scripts"
    for name, loaded in PAGES.items():
        page.goto(f"{server.url}/console/{name}")
        page.wait_for_selector(loaded)
        assert page.text_content("#viewer-key").startswith("zh-")
        page.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)
    assert tab.problems() == []


def test_a_data_plane_key_is_refused_by_the_console_and_the_admin_api(
    tab: ConsoleTab, server: LiveServer, keys: dict
) -> None:
    response = log_in(tab.page, server, keys["data"])
    assert response.status == 403
    assert tab.page.url == f"{server.url}/console/login"
    assert "is not an admin key" in tab.page.text_content("#login-error")
    assert tab.context.cookies() == []
    api = httpx.get(server.url + "/v1/admin/tenants", headers=headers_for(keys["data"]))
    assert api.status_code == 403 and api.json()["error"]["type"] == "permission_error"
    assert tab.problems(allowed=REFUSED) == []


def test_a_tenant_and_key_made_in_the_console_are_watched_in_use_and_revoked(
    tab: ConsoleTab, server: LiveServer, keys: dict
) -> None:
    page = tab.page
    tab.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
    log_in(page, server, keys["admin"])
    page.goto(f"{server.url}/console/tenants")
    page.wait_for_selector(PAGES["tenants"])

    # A tenant with a weight and a budget.
    page.fill("#tenant-name", "team-x")
    page.fill("#tenant-weight", "2")
    page.fill("#tenant-budget-tokens", "50000")
    page.click("#tenant-form button[type=submit]")
    row = page.wait_for_selector('#tenants-table tr[data-tenant="team-x"]')
    assert "50,000 / month" in row.text_content() and "2" in row.text_content()

    # A key in it, at most 3 requests a minute; its secret shown once, copied.
    page.fill("#key-tenant", "team-x")
    page.fill("#key-name", "svc")
    page.fill("#key-rpm", "3")
    page.click("#key-form button[type=submit]")
    page.wait_for_selector("#new-secret-box:not([hidden])")
    secret = page.text_content("#new-secret")
    key_id = secret[:KEY_ID_LENGTH]
    assert secret.startswith("zh-") and len(secret) > KEY_ID_LENGTH
    page.wait_for_selector(f'#keys-table tr[data-key="{key_id}"]')
    page.click("#copy-secret")
    page.wait_for_selector("#copy-status:text('Copied.')")
    assert page.evaluate("navigator.clipboard.readText()") == secret
    page.reload()
    page.wait_for_selector(f'#keys-table tr[data-key="{key_id}"]')
    assert page.is_hidden("#new-secret-box") and secret not in page.content()

    # The overview and usage move as the key is used.
    overview, usage = tab.new_page(), tab.new_page()
    overview.goto(f"{server.url}/console/overview")
    overview.wait_for_selector(PAGES["overview"])
    usage.goto(f"{server.url}/console/usage")
    usage.wait_for_selector("#usage-table tbody tr")
    before = number(overview, "#stat-requests")
    send(server, secret, 3)
    with pytest.raises(anthropic.RateLimitError):  # the 4th within the minute: rpm 3
        send(server, secret, 1)
    sent = time.monotonic()
    overview.wait_for_function(  # a function, not an expression: the CSP forbids eval
        "(n) => Number(document.querySelector('#stat-requests').textContent.replace(/,/g, ''))"
        " >= n",
        arg=before + 3,
        timeout=MOVES_WITHIN_MS,
    )
    output = f'#usage-table tr[data-key="{key_id}"] td:nth-child(6)'
    usage.wait_for_selector(f"{output}:text('15')", timeout=MOVES_WITHIN_MS)
    assert time.monotonic() - sent < MOVES_WITHIN_MS / 1000 + 0.5
    assert usage.text_content(f'#usage-table tr[data-key="{key_id}"] td:nth-child(2)') == "team-x"

    # The refusal, with the limit that refused.
    refusals = tab.new_page()
    refusals.goto(f"{server.url}/console/refusals")
    refused = f'#refusals-table tr:has(code:text("{key_id}"))'
    deadline = time.monotonic() + 10
    while not refusals.query_selector(refused):
        assert time.monotonic() < deadline, refusals.text_content("#refusals-table")
        refusals.click("#refusals-refresh")
        refusals.wait_for_timeout(200)
    assert "rate limit of 3 requests per minute" in refusals.text_content(refused)

    # Revoked in the console: its next request is refused.
    page.once("dialog", lambda dialog: dialog.accept())
    page.click(f'#keys-table tr[data-key="{key_id}"] button:text("Revoke")')
    page.wait_for_selector(f'#keys-table tr[data-key="{key_id}"]', state="detached")
    assert f"Revoked key {key_id}" in page.text_content("#notice")
    with pytest.raises(anthropic.AuthenticationError):
        send(server, secret, 1)
    page.check("#keys-show-all")
    assert "inactive" in page.text_content(f'#keys-table tr[data-key="{key_id}"]')

    # The audit log: the key's requests, the console's admin actions, the chain verified.
    page.goto(f"{server.url}/console/audit")
    page.wait_for_selector(PAGES["audit"])
    page.fill("#audit-form input[name=api_key_id]", key_id)
    page.click("#audit-form button[type=submit]")
    page.wait_for_function(
        "() => document.querySelectorAll('#audit-table tr[data-seq]').length >= 4"
    )
    statuses = page.locator("#audit-table tbody tr td:nth-child(6)").all_text_contents()
    assert {"200", "429"} <= set(statuses), statuses
    page.fill("#audit-form input[name=api_key_id]", "")
    page.select_option("#audit-form select[name=kind]", "admin")
    page.click("#audit-form button[type=submit]")
    page.wait_for_selector(f'#audit-table tr:has-text("key.create"):has-text("{key_id}")')
    page.wait_for_selector('#audit-table tr:has-text("console.login")')  # logins too
    page.click("#audit-verify")
    page.wait_for_selector("#audit-verify-result.ok")
    assert page.text_content("#audit-verify-result").startswith("Chain intact")
    assert tab.problems() == []


ATTACK = """<!doctype html><html><body>
<form id="f" method="post" action="{action}" enctype="{enctype}">{fields}</form>
<script>document.getElementById("f").submit()</script></body></html>"""


def test_forged_requests_are_refused(tab: ConsoleTab, server: LiveServer, keys: dict) -> None:
    page = tab.page
    log_in(page, server, keys["admin"])
    page.goto(f"{server.url}/console/tenants")
    page.wait_for_selector(PAGES["tenants"])
    forged = page.evaluate(
        """async () => {
          const put = (headers) => fetch("/v1/admin/tenants/forged", {method: "PUT",
            headers: {"content-type": "application/json", ...headers}, body: "{}"});
          const wrong = await put({"x-csrf-token": "not-the-token"});
          const none = await put({});
          return [wrong.status, (await wrong.json()).error.type, none.status];
        }"""
    )
    assert forged == [403, "permission_error", 403]
    names = [t["name"] for t in admin_get(server, keys, "/v1/admin/tenants")["data"]]
    assert "forged" not in names

    # Another site's page posting forms here: no key made, no logout.
    evil = "http://evil.test"
    attacks = {
        "/key": ATTACK.format(
            action=f"{server.url}/v1/admin/keys", enctype="text/plain",
            fields="""<input name='{"tenant": "evil", "x": "' value='"}'>""",
        ),
        "/logout": ATTACK.format(
            action=f"{server.url}/console/logout", enctype="application/x-www-form-urlencoded",
            fields='<input name="csrf" value="a-guess">',
        ),
    }  # fmt: skip
    tab.context.route(
        f"{evil}/**",
        lambda route: route.fulfill(
            content_type="text/html", body=attacks[route.request.url.removeprefix(evil)]
        ),
    )
    for path, refused in (("/key", (401, 403)), ("/logout", (403,))):
        with page.expect_response(lambda r: r.url.startswith(server.url)) as response:
            page.goto(evil + path)
        assert response.value.status in refused, (path, response.value.status)
    made = admin_get(server, keys, "/v1/organizations/api_keys?limit=1000&workspace_id=evil")
    assert made["data"] == []
    page.goto(f"{server.url}/console/overview")
    assert page.url == f"{server.url}/console/overview", "the forged logout ended the session"
    assert tab.problems(allowed=REFUSED) == []


def test_the_overview_charts_draw(tab: ConsoleTab, server: LiveServer, keys: dict) -> None:
    send(server, keys["data"], 6, max_tokens=8)
    page = tab.page
    log_in(page, server, keys["admin"])
    page.wait_for_selector(PAGES["overview"])
    page.wait_for_timeout(2100)  # two more polls: every chart has its points
    for chart, colours in CHARTS.items():
        png = page.locator(f"#{chart} canvas").screenshot()
        assert distinct_colours(png) > 1, f"{chart} is one flat colour"
        drawn = max(pixels_near(png, colour) for colour in colours)
        assert drawn > 20, f"{chart} drew no series line"
    shot = page.screenshot()
    if os.environ.get("ZEROHOP_SAVE_SCREENSHOT") == "1":
        (ROOT / "docs" / "console-overview.png").write_bytes(shot)
    assert tab.problems() == []
