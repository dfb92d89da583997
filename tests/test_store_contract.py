"""The Database contract (zerohop.gateway.store.open_store): every method gives the same
results on the SQLite file of one replica and on a fleet's PostgreSQL (a real server, a fresh
database per test); a row written badly by hand is refused as InvalidKey in both; a
PostgreSQL change is one transaction that bumps the version once, stamps its rows and
notifies."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.pg_fixtures import migrated_database, sql, with_password
from tests.postgres_server import PostgresServer
from zerohop.cli.errors import failure_line
from zerohop.gateway.keys.identity import Budget, Identity, Limits, Tenant
from zerohop.gateway.store.open_store import Database, StoreSpec, StoreUnavailable, open_database
from zerohop.gateway.store.rows import InvalidKey, KeyEntry, RevokedKey
from zerohop.gateway.store.sqlite import hash_secret

KINDS = ("sqlite", "postgresql")


def _open(kind: str, request: pytest.FixtureRequest, folder: Path) -> Database:
    if kind == "sqlite":
        return open_database(StoreSpec.sqlite(folder / "keys.db"))
    return open_database(StoreSpec.parse(migrated_database(request.getfixturevalue("postgres"))))


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    opened = _open(request.param, request, tmp_path)
    yield opened
    opened.close()


def is_sqlite(store: Database) -> bool:
    return isinstance(getattr(store, "conn", None), sqlite3.Connection)


def hand_edit(store: Database, statement: str) -> None:
    """A row changed behind the store's back, as `sqlite3` or `psql` would."""
    if is_sqlite(store):
        store.conn.execute(statement)
    else:
        sql(store.url, statement)


# -- the same results ------------------------------------------------------------------------


def _script(store: Database) -> dict[str, Any]:
    """Every method once, on a fresh store; what each returned, without times or secrets."""
    out: dict[str, Any] = {"empty": (store.has_keys(), store.tenants(), store.list_keys())}
    store.upsert_tenant(Tenant("acme", Limits(rpm=60, otpm=1000), Budget(5000, "month"), 2.0))
    store.ensure_tenant("acme")  # exists: unchanged
    store.ensure_tenant("beta")
    secret, first = store.create_key(
        "acme", name="ci", models=["m1", "m2"], priority="batch",
        limits=Limits(itpm=500, max_concurrency=2), budget=Budget(100, "day"),
    )  # fmt: skip
    _, second = store.create_key("gamma", expires=time.time() + 3600)  # a new tenant
    store.update_key(second.key_id, tenant="beta", name="moved", limits=Limits(rpm=7))
    store.update_key(first.key_id, budget=None, models=[])
    revoked = [store.revoke_key(second.key_id), store.revoke_key(second.key_id)]
    version, index = store.snapshot()
    out |= {
        "tenants": store.tenants(),
        "tenant_rows": store.tenant_rows(),
        "acme": store.tenant("acme"),
        "nobody": (store.tenant("nobody"), store.tenant_row("nobody"), store.key("zh-nothing")),
        "keys": [_plain(r.as_dict()) for r in store.list_keys()],
        "key": _plain(store.key(first.key_id).as_dict()),
        "revoked": revoked,
        "has_keys": store.has_keys(),
        "snapshot": sorted((h == hash_secret(secret), _entry(i)) for h, i in index.items()),
        "version_matches": version == store.version(),
    }
    with pytest.raises(KeyError):
        store.update_key("zh-nothing", name="x")
    return out


def _plain(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in ("key_id", "created", "expires")} | {
        "revoked": record["revoked"] is not None
    }


def _entry(entry: KeyEntry) -> Any:
    if isinstance(entry, RevokedKey):  # refused, kept for the audit to name
        return ("revoked", entry.tenant)
    assert isinstance(entry, Identity)
    return (entry.tenant, entry.name, entry.models, entry.priority, entry.limits, entry.budget)


def test_every_method_gives_the_same_results_on_sqlite_and_postgresql(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    results = {}
    for kind in KINDS:
        opened = _open(kind, request, tmp_path)
        try:
            results[kind] = _script(opened)
        finally:
            opened.close()
    assert results["sqlite"] == results["postgresql"]
    got = results["postgresql"]
    assert [t.name for t in got["tenants"]] == ["acme", "beta", "gamma"]
    assert got["acme"] == Tenant("acme", Limits(rpm=60, otpm=1000), Budget(5000, "month"), 2.0)
    assert got["revoked"] == [True, False]
    assert got["has_keys"] and got["version_matches"]
    limits = Limits(itpm=500, max_concurrency=2)
    assert got["snapshot"] == [
        (False, ("revoked", "beta")),
        (True, (got["acme"], "ci", (), "batch", limits, None)),
    ]


def test_every_change_moves_the_version_on(store: Database) -> None:
    seen = [store.version()]
    store.ensure_tenant("t")
    seen.append(store.version())
    _, record = store.create_key("t")
    seen.append(store.version())
    store.update_key(record.key_id, name="n")
    seen.append(store.version())
    store.revoke_key(record.key_id)
    seen.append(store.version())
    store.upsert_tenant(Tenant("t", Limits(rpm=1)))
    seen.append(store.version())
    assert seen == sorted(set(seen)), seen  # strictly increasing
    assert store.snapshot()[0] == store.version()


def test_spend_lists_each_subject_and_period(store: Database) -> None:
    assert store.spend() == []
    if is_sqlite(store):
        rows = "spend VALUES ('tenant:a', 'total', 15), ('key:zh-1', 'day:2030-01-01', 3)"
    else:  # settled + leased: what the fleet has spent or may still spend
        rows = (
            "budget_state VALUES ('tenant:a', 'total', 10, 5), ('key:zh-1', 'day:2030-01-01', 3, 0)"
        )
    hand_edit(store, f"INSERT INTO {rows}")
    assert store.spend() == [("key:zh-1", "day:2030-01-01", 3), ("tenant:a", "total", 15)]


# -- rows written badly by hand ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("statement", "fields"),
    [
        ("UPDATE keys SET rpm = -5", ("keys.rpm",)),
        ("UPDATE keys SET models = 'not json'", ("keys.models",)),
        (
            "UPDATE keys SET priority = 'urgent', budget_tokens = 0",
            ("keys.priority", "keys.budget_tokens"),
        ),
        ("UPDATE tenants SET weight = -1", ("tenants.weight",)),
    ],
)
def test_an_invalid_row_is_refused_as_invalid_key(
    store: Database, statement: str, fields: tuple[str, ...]
) -> None:
    secret, bad = store.create_key("bad")
    good_secret, _good = store.create_key("good")
    on_keys = statement.startswith("UPDATE keys")
    row = f"key_id = '{bad.key_id}'" if on_keys else "name = 'bad'"
    hand_edit(store, f"{statement} WHERE {row}")
    _version, index = store.snapshot()
    refused = index[hash_secret(secret)]
    assert isinstance(refused, InvalidKey) and refused.key_id == bad.key_id
    assert refused.fields == fields
    assert isinstance(index[hash_secret(good_secret)], Identity)  # the others are served
    problems = store.key(bad.key_id).problems if on_keys else store.tenant_row("bad").problems
    assert set(problems) == set(fields)


def test_a_key_without_its_tenant_row_is_refused(store: Database) -> None:
    secret, _record = store.create_key("gone")
    if is_sqlite(store):
        hand_edit(store, "PRAGMA foreign_keys = OFF")
    else:
        hand_edit(store, "ALTER TABLE keys DROP CONSTRAINT keys_tenant_fkey")
    hand_edit(store, "DELETE FROM tenants WHERE name = 'gone'")
    entry = store.snapshot()[1][hash_secret(secret)]
    assert isinstance(entry, InvalidKey) and entry.fields == ("keys.tenant",)


# -- PostgreSQL: one transaction per change, and errors in one line -----------------------------


def test_a_postgresql_change_bumps_once_stamps_its_rows_and_notifies(
    postgres: PostgresServer,
) -> None:
    url = migrated_database(postgres)
    store = open_database(StoreSpec.parse(url))
    listener = psycopg.connect(url, autocommit=True)
    try:
        listener.execute("LISTEN zerohop_keys")
        before = store.version()
        _, record = store.create_key("fresh")  # tenant and key: one change
        assert store.version() == before + 1
        stamps = sql(
            url,
            f"SELECT change_version FROM keys WHERE key_id = '{record.key_id}'"
            " UNION ALL SELECT change_version FROM tenants WHERE name = 'fresh'",
        )
        assert stamps == [(before + 1,), (before + 1,)]
        notes = list(listener.notifies(timeout=2, stop_after=1))
        assert json.loads(notes[0].payload)["v"] == before + 1
        assert abs(json.loads(notes[0].payload)["t"] - time.time()) < 5
    finally:
        listener.close()
        store.close()


def test_an_unreachable_postgresql_is_one_line_without_its_password(tmp_path: Path) -> None:
    url = with_password("postgresql://zerohop@127.0.0.1:9/zerohop", "s3cret-pw")
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as caught:
        open_database(StoreSpec.parse(url))
    assert time.monotonic() - started < 5
    line = failure_line(caught.value)
    assert line is not None and "\n" not in line and "s3cret" not in line
    assert line.startswith("the key store postgresql://zerohop:***@127.0.0.1:9/zerohop: ")
    assert "Connection refused" in line


@pytest.mark.parametrize(
    ("text", "kind", "described"),
    [
        ("postgresql://u:pw@db.example:5432/zh?sslmode=verify-full", "postgresql",
         "postgresql://u:***@db.example:5432/zh?sslmode=verify-full"),
        ("postgres://u@db/zh?password=pw&application_name=x", "postgresql",
         "postgres://u@db/zh?password=***&application_name=x"),
        ("sqlite:///var/lib/zerohop/keys.db", "sqlite", "/var/lib/zerohop/keys.db"),
        ("/tmp/keys.db", "sqlite", "/tmp/keys.db"),
    ],
)  # fmt: skip
def test_a_store_spec_never_shows_a_password(text: str, kind: str, described: str) -> None:
    spec = StoreSpec.parse(text)
    assert (spec.kind, spec.describe()) == (kind, described)
    assert "pw" not in repr(spec).replace("password", "")
    if kind == "postgresql":  # the password in an error message is masked too
        wrapped = StoreUnavailable.wrap(RuntimeError("failed for u:pw somewhere"), text)
        assert "pw" not in str(wrapped).replace("password", ""), wrapped


# -- usage per minute (the admin API's reports) --------------------------------------------------


def test_usage_rows_add_up_and_are_bucketed_in_either_store(store: Database) -> None:
    from zerohop.gateway.store.usage_tables import RefusalRow, UsageRow

    day = 1_700_006_400  # a UTC midnight
    first = [UsageRow(day + 60, "zh-a", "t", "m", 1, 0, 10, 5, 20)]
    again = [UsageRow(day + 60, "zh-a", "t", "m", 2, 1, 1, 0, 2),  # the same row: adds
             UsageRow(day + 3600, "zh-b", "u", "m", 1, 0, 7, 0, 3)]  # fmt: skip
    store.add_usage(first, [RefusalRow(day, "zh-a", "t", "rpm", 2, day + 1.0, "old")])
    store.add_usage(again, [RefusalRow(day + 60, "zh-a", "t", "rpm", 1, day + 61.0, "new")])
    minutes = store.usage(60, day, day + 86400)
    assert minutes == [
        UsageRow(day + 60, "zh-a", "t", "m", 3, 1, 11, 5, 22),
        UsageRow(day + 3600, "zh-b", "u", "m", 1, 0, 7, 0, 3),
    ]
    assert store.usage(86400, day, day + 86400) == [
        UsageRow(day, "zh-a", "t", "m", 3, 1, 11, 5, 22),
        UsageRow(day, "zh-b", "u", "m", 1, 0, 7, 0, 3),
    ]
    assert store.usage(60, day + 120, day + 86400) == minutes[1:]  # since is inclusive
    refusals = store.refusals(day, day + 86400)
    assert [(r.reason, r.count, r.last_at, r.last_message) for r in refusals] == [
        ("rpm", 3, day + 61.0, "new")
    ]
