"""Usage per trusted front's end user (issue 51): the recorder's end-user rows beside the
totals and their cap (real SQLite); the admin API's usage report by end user on a real
`zerohop serve --trusted-front 127.0.0.1`, summing to the key's total; the table on a real
PostgreSQL migrated from schema version 8; the console's usage page's table per end user."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.browser import ConsoleTab, launch_browser
from tests.live_server import MODEL_NAME, LiveServer
from tests.pg_fixtures import fresh_database
from tests.postgres_server import PostgresServer
from tests.test_gateway_auth import cli_json, headers_for, poll
from tests.test_usage_recorder import MINUTE, Clock, call
from zerohop.gateway.store.pg_migrations import Migrated, _apply, migrate, schema_version
from zerohop.gateway.store.pg_schema import MIN_READER, PG_MIGRATIONS, SCHEMA_VERSION
from zerohop.gateway.store.postgres import PostgresStore
from zerohop.gateway.store.sqlite import KeyStore
from zerohop.gateway.store.store import Store
from zerohop.gateway.store.usage_tables import UsageRow
from zerohop.gateway.usage import UsageRecorder

REPORT = "/v1/organizations/usage_report/messages"


def served(end_user: str | None = None, email: str | None = None, output: int = 6) -> Any:
    return call("zh-a", "t", decision="admitted", prompt_tokens=10, cached_tokens=4,
                output_tokens=output, status=200, end_user=end_user,
                end_user_email=email)  # fmt: skip


def sums(rows: list[UsageRow]) -> tuple[int, ...]:
    return tuple(map(sum, zip(*(r.counts() for r in rows), strict=True)))


def test_the_recorder_attributes_named_end_users_up_to_its_cap(tmp_path: Path) -> None:
    clock = Clock()
    store = KeyStore(tmp_path / "keys.db")
    recorder = UsageRecorder(
        Store(lambda: KeyStore(tmp_path / "keys.db")).usage, clock=clock, max_end_users=2
    )
    recorder.record(served("sub-1", "ada@example.com", output=1))  # the email names her
    recorder.record(served("sub-1", "ada@example.com", output=2))
    recorder.record(served("bob", output=3))  # LiteLLM's id alone
    recorder.record(served("carol", output=4))  # a third this minute: past the cap
    recorder.record(served(output=5))  # no front named anyone
    assert recorder.flush()
    totals = store.usage(60, MINUTE, MINUTE + 60)
    assert totals == [UsageRow(MINUTE, "zh-a", "t", "m", 5, 0, 30, 20, 15)]  # as before
    split = store.usage(60, MINUTE, MINUTE + 60, by_end_user=True)
    assert [(r.end_user, r.requests, r.output_tokens) for r in split] == [
        ("", 2, 9), ("ada@example.com", 2, 3), ("bob", 1, 3)]  # fmt: skip
    assert sums(split) == totals[0].counts()
    clock.now += 60  # a new minute: the cap starts over
    recorder.record(served("carol", output=4))
    recorder.close()
    later = store.usage(60, MINUTE + 60, MINUTE + 120, by_end_user=True)
    assert [(r.end_user, r.output_tokens) for r in later] == [("carol", 4)]
    with pytest.raises(ValueError):
        UsageRecorder(Store.in_memory().usage, max_end_users=-1)


# -- a real server behind a trusted front ---------------------------------------------------


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    db = tmp_path_factory.mktemp("end_user_keys") / "keys.db"
    made = {
        name: cli_json("keys", "create", "--keys-db", db, "--tenant", tenant, *flags)
        for name, (tenant, flags) in {
            "admin": ("ops", ["--admin"]), "dev": ("fleet", []), "other": ("fleet", [])
        }.items()
    }  # fmt: skip
    return {"db": db, **made}


@pytest.fixture(scope="module")
def server(
    llama_dir: Path, keys: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("end_user_server") / "server.log"
    args = ["--keys-db", str(keys["db"]), "--trusted-front", "127.0.0.1"]
    srv = LiveServer(llama_dir, args).start(log)
    yield srv
    srv.stop()


def ask(server: LiveServer, key: str, end_user: str | None) -> int:
    """One message as `end_user` (LiteLLM's header); its output tokens."""
    body = {"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    named = {"x-litellm-end-user-id": end_user} if end_user else {}
    answer = httpx.post(
        server.url + "/v1/messages", json=body, headers={**headers_for(key), **named}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["output_tokens"])


def report(server: LiveServer, keys: dict[str, Any], **params: Any) -> list[dict[str, Any]]:
    start = time.strftime("%Y-%m-%dT00:00:00Z", time.gmtime(time.time() - 3600))
    answer = httpx.get(
        server.url + REPORT, headers=headers_for(keys["admin"]["key"]), timeout=30,
        params={"starting_at": start, "bucket_width": "1h", "limit": 48, **params},
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    return [r for bucket in answer.json()["data"] for r in bucket["results"]]


def per(results: list[dict[str, Any]], field: str) -> dict[Any, tuple[int, int, int]]:
    out: dict[Any, tuple[int, int, int]] = {}
    for r in results:
        name = r["zerohop"]["end_user"] if field == "end_user" else r[field]
        had = out.get(name, (0, 0, 0))
        out[name] = (had[0] + r["zerohop"]["requests"], had[1] + r["uncached_input_tokens"],
                     had[2] + r["output_tokens"])  # fmt: skip
    return out


def test_the_usage_report_per_end_user_sums_to_the_keys(server: LiveServer, keys: dict) -> None:
    dev, other = keys["dev"], keys["other"]
    outputs = {"ada@example.com": ask(server, dev["key"], "ada@example.com")}
    outputs["ada@example.com"] += ask(server, dev["key"], "ada@example.com")
    outputs["bob"] = ask(server, dev["key"], "bob")
    outputs[""] = ask(server, dev["key"], None)
    ask(server, other["key"], "bob")  # another key: bob's use there is that key's
    mine = {"api_key_ids[]": dev["key_id"]}

    def requests_reported() -> bool:
        grouped = report(server, keys, **mine, **{"group_by[]": "api_key_id"})
        return per(grouped, "api_key_id").get(dev["key_id"], (0,))[0] == 4

    poll(requests_reported, timeout=10)
    poll(lambda: len(report(server, keys, **{"group_by[]": "end_user"})) == 3, timeout=10)
    total = per(report(server, keys, **mine, **{"group_by[]": "api_key_id"}), "api_key_id")
    by_user = per(report(server, keys, **mine, **{"group_by[]": "end_user"}), "end_user")
    assert {name: (n, out) for name, (n, _, out) in by_user.items()} == {
        "ada@example.com": (2, outputs["ada@example.com"]), "bob": (1, outputs["bob"]),
        "": (1, outputs[""])}  # fmt: skip
    summed = tuple(map(sum, zip(*by_user.values(), strict=True)))
    assert summed == total[dev["key_id"]] and summed[1] > 0
    # Grouped by key and end user, filtered to bob: his use under each key.
    bob = report(server, keys, **{"group_by[]": ["api_key_id", "end_user"], "end_users": "bob"})
    assert sorted(r["api_key_id"] for r in bob) == sorted([dev["key_id"], other["key_id"]])
    assert {r["zerohop"]["end_user"] for r in bob} == {"bob"}
    # Not asked for: no end user named, the report as before.
    plain = report(server, keys, **mine)
    assert [r["zerohop"]["end_user"] for r in plain] == [None] * len(plain)
    bad = httpx.get(
        server.url + REPORT,
        headers=headers_for(keys["admin"]["key"]),
        params={"starting_at": "2026-01-01T00:00:00Z", "group_by": "end_usr"},
    )
    assert bad.status_code == 400 and "group_by" in bad.json()["error"]["message"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from launch_browser()


def test_the_consoles_usage_page_has_a_table_per_end_user(
    browser: Any, server: LiveServer, keys: dict
) -> None:
    ask(server, keys["dev"]["key"], "carol")
    tab = ConsoleTab.open(browser)
    try:
        page = tab.page
        page.goto(f"{server.url}/console/login")
        page.fill("#key", keys["admin"]["key"])
        page.click("#login-form button[type=submit]")
        page.wait_for_load_state()
        page.goto(f"{server.url}/console/usage")
        row = page.wait_for_selector("#usage-end-users tbody tr[data-end-user='carol']")
        assert row is not None and keys["dev"]["key_id"] in row.text_content()
        assert page.is_visible("#usage-end-users")
        shown = page.eval_on_selector_all(
            "#usage-end-users tbody tr", "rows => rows.map(r => r.dataset.endUser)"
        )
        assert "" not in shown  # the unnamed rest stays in the per-key tables only
        assert tab.problems() == []
    finally:
        tab.close()


# -- PostgreSQL -----------------------------------------------------------------------------


def test_migration_9_adds_the_end_user_table_to_a_version_8_store(
    postgres: PostgresServer,
) -> None:
    url = fresh_database(postgres)
    with psycopg.connect(url) as conn:
        for version, sql in PG_MIGRATIONS:
            if version <= 8:
                _apply(conn, version, sql)
        assert schema_version(conn) == 8
    assert migrate(url) == Migrated([9], 9) and SCHEMA_VERSION == 9
    assert MIN_READER[9] == MIN_READER[8] == 2  # additive: an older zerohop serves beside it
    store = PostgresStore(url)
    try:
        rows = [UsageRow(MINUTE, "zh-a", "t", "m", 3, 1, 30, 3, 9),
                UsageRow(MINUTE, "zh-a", "t", "m", 2, 1, 20, 2, 5, end_user="ada"),
                UsageRow(MINUTE, "zh-a", "t", "m", 1, 0, 10, 1, 4, end_user="bob")]  # fmt: skip
        store.add_usage(rows, [])
        store.add_usage(rows[:2], [])  # replicas add into the same rows
        (total,) = store.usage(60, MINUTE, MINUTE + 60)
        assert total.counts() == (6, 2, 60, 6, 18)
        split = store.usage(60, MINUTE, MINUTE + 60, by_end_user=True)
        assert [(r.end_user, r.requests) for r in split] == [("", 1), ("ada", 4), ("bob", 1)]
        assert sums(split) == total.counts()
    finally:
        store.close()
