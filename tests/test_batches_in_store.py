"""The batch store is opened by the process's one store (zerohop.gateway.store.store.Store),
never by itself: on a fleet's PostgreSQL it runs on the store's one pool (no connection of
its own in pg_stat_activity, and the store's close closes it); on SQLite the store opens the
batches' file once and closes it. Real PostgreSQL and real files, no mocks."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pg_fixtures import migrated_database, sql
from tests.postgres_server import PostgresServer
from zerohop.batches.pg_store import PgBatchStore
from zerohop.batches.store import SUCCEEDED, BatchStore, NewBatch, NewFile, NewLine
from zerohop.gateway.store.spec import StoreSpec
from zerohop.gateway.store.store import Store

# Every backend of the test's database but the one asking.
OTHERS = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
)


@pytest.fixture
def url(postgres: PostgresServer) -> str:
    return migrated_database(postgres)


@pytest.fixture
def fleet_store(url: str) -> Iterator[Store]:
    store = Store.of(StoreSpec.parse(url))
    yield store
    store.close()


def run_a_batch(batches: BatchStore | PgBatchStore) -> None:
    """A batch made, one line run and answered, the batch ended with an output file."""
    spec = NewBatch("acme", "zh-acme", "anthropic", "/v1/messages", model="tiny")
    batch = batches.create_batch(spec, [NewLine("a", {"n": 1}), NewLine("b", {"n": 2})])
    assert batches.mark_running(batch.id, 0)
    assert batches.record_result(batch.id, 0, SUCCEEDED, {"ok": True})
    batches.cancel_batch("acme", batch.id)
    ended = batches.finish_batch(batch.id, output=NewFile("out.jsonl", b"{}\n"))
    assert ended is not None and ended.output_file_id is not None


def test_fleet_batches_use_the_stores_one_pool(fleet_store: Store, url: str) -> None:
    batches = PgBatchStore.of(fleet_store, "replica-a")
    run_a_batch(batches)
    pool = fleet_store.postgres_pool()
    assert batches.conn.pool() is pool
    # The only backends on the database are the store pool's: the batches opened none.
    assert sql(url, OTHERS) == [(pool.get_stats()["pool_size"],)]


def test_closing_the_store_closes_the_batches_pool(fleet_store: Store) -> None:
    batches = PgBatchStore.of(fleet_store, "replica-a")
    run_a_batch(batches)
    pool = batches.conn.pool()
    fleet_store.close()
    assert pool.closed


def test_a_sqlite_store_has_no_pool_for_the_batches(tmp_path: Path) -> None:
    store = Store.of(StoreSpec.sqlite(tmp_path / "keys.db"))
    batches = PgBatchStore.of(store, "replica-a")
    with pytest.raises(TypeError, match="not a PostgreSQL store"):
        batches.batch(None, "batch_none")
    store.close()


def test_the_store_opens_the_batch_file_once_and_closes_it(tmp_path: Path) -> None:
    store = Store.in_memory()
    path = tmp_path / "batches.db"
    batches = BatchStore.of(store, path)
    run_a_batch(batches)
    file = store.batch_file(path, "")
    assert batches.conn is file.conn and batches._lock is file.lock  # one connection, one lock
    store.close()
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        batches.conn.execute("SELECT 1")
    assert (tmp_path / "batches-files").is_dir()  # the contents beside the file, as before
