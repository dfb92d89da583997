"""`zerohop store migrate` on a real PostgreSQL: a fresh database to this zerohop's schema, a
second run and concurrent runs that change nothing more; a store that is not migrated (or is
newer than this zerohop reads) refused in one line by the store and by `serve`; and `zerohop
keys --store` / `zerohop store status` through the real command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.pg_fixtures import (
    fresh_database,
    migrated_database,
    sql,
    with_password,
)
from tests.postgres_server import PostgresServer
from zerohop import __version__
from zerohop.app.server import GatewayOptions, ServeOptions, check_open_mode
from zerohop.cli import main
from zerohop.cli.errors import failure_line
from zerohop.gateway.store.open_store import SchemaMismatch, StoreUnavailable
from zerohop.gateway.store.pg_migrations import Migrated, migrate
from zerohop.gateway.store.pg_schema import MIN_READER, PG_MIGRATIONS, SCHEMA_VERSION
from zerohop.gateway.store.postgres import PostgresStore
from zerohop.gateway.store.spec import STORE_ENV

ALL_VERSIONS = [version for version, _ in PG_MIGRATIONS]


def zerohop(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != STORE_ENV} | (env or {})
    command = [sys.executable, "-m", "zerohop", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=environ)


def test_a_fresh_store_is_migrated_to_this_schema_once(postgres: PostgresServer) -> None:
    url = fresh_database(postgres)
    assert migrate(url) == Migrated(ALL_VERSIONS, SCHEMA_VERSION)
    rows = sql(
        url,
        "SELECT version, min_reader, zerohop, applied_at IS NOT NULL FROM zerohop_schema"
        " ORDER BY version",
    )
    assert rows == [(v, MIN_READER[v], __version__, True) for v in ALL_VERSIONS]
    tables = {r[0] for r in sql(url, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    expected = {"store_meta", "keys", "tenants", "budget_state", "leases", "replicas"}
    assert expected | {"usage_minutes", "refusal_minutes"} <= tables
    assert migrate(url) == Migrated([], SCHEMA_VERSION)  # again: nothing to do
    assert sql(url, "SELECT count(*) FROM zerohop_schema") == [(len(ALL_VERSIONS),)]
    PostgresStore(url).close()


def test_concurrent_migrates_apply_each_step_once(postgres: PostgresServer) -> None:
    url = fresh_database(postgres)
    start = threading.Barrier(4)
    results: list[Migrated | BaseException] = []

    def run() -> None:
        start.wait()
        try:
            results.append(migrate(url))
        except BaseException as exc:
            results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    # Each step in its own transaction: the runs may share the steps, each applied once.
    assert len(results) == 4 and all(isinstance(r, Migrated) for r in results), results
    applied = [version for r in results if isinstance(r, Migrated) for version in r.applied]
    assert sorted(applied) == ALL_VERSIONS
    assert sql(url, "SELECT count(*) FROM zerohop_schema") == [(len(ALL_VERSIONS),)]


@pytest.mark.parametrize(
    ("prepare", "words"),
    [
        ("SELECT 1", "has no zerohop schema: run `zerohop store migrate`"),
        (
            "CREATE TABLE zerohop_schema (version int PRIMARY KEY, min_reader int NOT NULL)",
            f"has schema version 0 and this zerohop needs {SCHEMA_VERSION}:"
            " run `zerohop store migrate`",
        ),
    ],
)
def test_an_unmigrated_store_is_refused_in_one_line(
    postgres: PostgresServer, prepare: str, words: str
) -> None:
    url = fresh_database(postgres)
    sql(url, prepare)
    with pytest.raises(SchemaMismatch) as caught:
        PostgresStore(url)
    line = failure_line(caught.value)
    assert line is not None and "\n" not in line and words in line


def test_a_newer_schema_is_served_unless_it_needs_a_newer_reader(
    postgres: PostgresServer,
) -> None:
    url = migrated_database(postgres)
    newer = SCHEMA_VERSION + 1
    sql(url, f"INSERT INTO zerohop_schema (version, min_reader) VALUES ({newer}, 1)")
    PostgresStore(url).close()  # additive: this zerohop may still serve on it
    sql(url, f"UPDATE zerohop_schema SET min_reader = {newer} WHERE version = {newer}")
    with pytest.raises(SchemaMismatch, match="upgrade zerohop"):
        PostgresStore(url)


def test_serve_refuses_an_unmigrated_store_in_one_line(
    postgres: PostgresServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(STORE_ENV, with_password(fresh_database(postgres), "s3cret-pw"))
    args = ["serve", str(tmp_path), "--port", "0", "--keys-db", str(tmp_path / "replica.db")]
    assert main(args) == 1  # refused before the model loads (tmp_path holds none)
    out = capsys.readouterr()
    assert "s3cret" not in out.err + out.out
    (line,) = out.err.strip().splitlines()
    assert line.startswith("zerohop: the key store postgresql://postgres:***@"), line
    assert "has no zerohop schema: run `zerohop store migrate`" in line


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_serve_refuses_an_unreachable_store_before_loading_anything(
    host: str, tmp_path: Path
) -> None:
    url = with_password("postgresql://postgres@127.0.0.1:9/zerohop", "s3cret-pw")
    options = ServeOptions(tmp_path, host=host, gateway=GatewayOptions(store=url))
    with pytest.raises(StoreUnavailable) as caught:
        check_open_mode(options)  # the first thing `serve` does, loopback or not
    line = failure_line(caught.value)
    assert line is not None and "Connection refused" in line and "s3cret" not in line


def test_keys_and_store_commands_work_on_the_store(
    postgres: PostgresServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = fresh_database(postgres)
    monkeypatch.delenv(STORE_ENV, raising=False)
    assert main(["store", "migrate", "--store", url]) == 0
    assert "applied schema version 1" in capsys.readouterr().out
    assert main(["keys", "create", "--tenant", "acme", "--rpm", "60", "--store", url]) == 0
    assert capsys.readouterr().out.startswith("key: zh-")
    assert main(["keys", "list", "--json", "--store", url]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert (listed["tenant"], listed["limits"]["rpm"]) == ("acme", 60)
    assert main(["store", "status", "--json", "--store", url]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["schema_version"], status["keys"], status["tenants"]) == (SCHEMA_VERSION, 1, 1)
    assert (status["live_replicas"], status["active_leases"]) == (0, 0)
    keys_db = ["--keys-db", "x.db", "--store", url]
    assert main(["keys", "list", *keys_db]) == 2
    assert "give one" in capsys.readouterr().err
    assert main(["store", "migrate"]) == 0  # no store configured: nothing to do
    assert "no PostgreSQL store to migrate" in capsys.readouterr().out


def test_keys_read_the_store_from_the_environment(postgres: PostgresServer) -> None:
    url = with_password(migrated_database(postgres), "s3cret-pw")
    env = {STORE_ENV: url}
    created = zerohop("keys", "create", "--tenant", "env", "--json", env=env)
    assert created.returncode == 0, created.stderr
    key_id = json.loads(created.stdout)["key_id"]
    listed = zerohop("keys", "list", "--json", env=env)
    assert [k["key_id"] for k in json.loads(listed.stdout)] == [key_id]
    status = zerohop("store", "status", env=env)
    assert "store: postgresql://postgres:***@" in status.stdout and "s3cret" not in status.stdout


def test_a_role_that_may_only_read_and_write_rows_migrates_a_current_store(
    postgres: PostgresServer,
) -> None:
    # As deploy/kubernetes/README.md suggests: the owner migrates, replicas get DML only,
    # and their init container's `zerohop store migrate` must then be a no-op, not an error.
    url = migrated_database(postgres)
    database = url.rpartition("/")[2]
    sql(url, "DROP ROLE IF EXISTS dml_only")
    sql(url, "CREATE ROLE dml_only LOGIN")
    sql(url, "REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    sql(url, "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO dml_only")
    sql(url, "GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO dml_only")
    dml_url = url.replace("postgres@", "dml_only@")
    assert migrate(dml_url) == Migrated([], SCHEMA_VERSION)
    assert database in dml_url
