"""Batch lines shared by replicas through the PostgreSQL fleet store (a real server): a line
runs on one replica at a time, a dead replica's lines go back to waiting when their lease
ends, a line abandoned too often is errored, each line keeps exactly one result, and a batch
ends once with one set of files, whichever replicas race to end it. The SQLite store's
counterpart of the attempt cap (a crash while a line runs, again and again) is here too."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pg_fixtures import migrated_database, sql
from tests.postgres_server import PostgresServer
from zerohop.batches.pg_store import PgBatchStore
from zerohop.batches.records import MAX_LINE_ATTEMPTS
from zerohop.batches.store import (
    ENDED,
    ERRORED,
    RUNNING,
    SUCCEEDED,
    WAITING,
    BatchStore,
    NewBatch,
    NewFile,
    NewLine,
)
from zerohop.gateway.store.spec import StoreSpec
from zerohop.gateway.store.store import Store

TTL = 30.0


@pytest.fixture
def url(postgres: PostgresServer) -> str:
    return migrated_database(postgres)


@pytest.fixture
def replicas(url: str) -> Iterator[tuple[PgBatchStore, PgBatchStore]]:
    """Two replicas' batch stores, each on its process's one store."""
    stores = [Store.of(StoreSpec.parse(url)) for _ in range(2)]
    yield PgBatchStore.of(stores[0], "replica-a", TTL), PgBatchStore.of(stores[1], "replica-b", TTL)
    for store in stores:
        store.close()


def new_batch(store: BatchStore, lines: int = 2, endpoint: str = "/v1/messages") -> str:
    api = "anthropic" if endpoint == "/v1/messages" else "openai"
    spec = NewBatch("acme", "zh-acme", api, endpoint, model="tiny")
    return store.create_batch(spec, [NewLine(f"l{i}", {"n": i}) for i in range(lines)]).id


def states(store: BatchStore, batch_id: str) -> list[str]:
    return [line.state for line in store.lines(batch_id)]


def test_any_replica_reads_a_batch_and_a_line_runs_on_one(
    replicas: tuple[PgBatchStore, PgBatchStore], url: str
) -> None:
    a, b = replicas
    batch_id = new_batch(a)
    assert b.batch("acme", batch_id) == a.batch("acme", batch_id)
    assert [w.line.index for w in b.next_waiting(5)] == [0, 1]
    assert a.mark_running(batch_id, 0)
    assert not b.mark_running(batch_id, 0), "taken by the other replica"
    assert [w.line.index for w in b.next_waiting(5)] == [1]
    owner = sql(url, f"SELECT lease_owner FROM lines WHERE batch_id = '{batch_id}'")
    assert sorted(owner, key=str) == sorted([("replica-a",), (None,)], key=str)


def test_a_dead_replicas_lines_wait_again_when_their_lease_ends(
    replicas: tuple[PgBatchStore, PgBatchStore],
) -> None:
    a, b = replicas
    batch_id = new_batch(a, lines=1)
    assert a.mark_running(batch_id, 0, now=1000.0)
    assert b.expire_leases(now=1000.0 + TTL - 1) == 0, "the lease still holds"
    assert a.renew_leases(now=1020.0) == 1
    assert b.expire_leases(now=1000.0 + TTL + 1) == 0, "renewed: it holds to 1050"
    assert b.expire_leases(now=1020.0 + TTL + 1) == 1  # replica-a stopped renewing
    assert states(b, batch_id) == [WAITING]
    assert b.mark_running(batch_id, 0)
    assert b.line(batch_id, 0).attempts == 2
    # replica-a comes back and answers first: its result is the one; b's is refused.
    assert a.record_result(batch_id, 0, SUCCEEDED, {"by": "a"})
    assert not b.record_result(batch_id, 0, SUCCEEDED, {"by": "b"})
    assert b.line(batch_id, 0).result == {"by": "a"}


def test_a_line_abandoned_too_often_is_errored(
    replicas: tuple[PgBatchStore, PgBatchStore],
) -> None:
    a, b = replicas
    batch_id = new_batch(a, lines=1, endpoint="/v1/chat/completions")
    now = 1000.0
    for attempt in range(1, MAX_LINE_ATTEMPTS + 1):
        assert a.mark_running(batch_id, 0, now=now)
        now += TTL + 1
        assert b.expire_leases(now=now) == 1
        expected = WAITING if attempt < MAX_LINE_ATTEMPTS else ERRORED
        assert states(b, batch_id) == [expected], attempt
    line = b.line(batch_id, 0)
    assert line.result["status_code"] == 500
    assert "3 times" in line.result["body"]["error"]["message"]  # the OpenAI error shape
    assert not a.mark_running(batch_id, 0)


def test_a_batch_ends_once_whoever_races_to_end_it(
    replicas: tuple[PgBatchStore, PgBatchStore], url: str
) -> None:
    a, b = replicas
    batch_id = new_batch(a, lines=1)
    a.mark_running(batch_id, 0)
    a.record_result(batch_id, 0, SUCCEEDED, {})
    barrier, ended = threading.Barrier(2), []

    def end(store: PgBatchStore, body: bytes) -> None:
        barrier.wait()
        ended.append(store.finish_batch(batch_id, output=NewFile("out.jsonl", body)))

    threads = [threading.Thread(target=end, args=(s, s.owner.encode())) for s in (a, b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [record for record in ended if record is not None]
    assert len(winners) == 1 and winners[0].status == ENDED
    output = b.file("acme", winners[0].output_file_id)
    assert a.read_file(output) in (b"replica-a", b"replica-b")
    assert sql(url, "SELECT count(*) FROM files") == [(1,)]
    assert sql(url, "SELECT count(*) FROM file_contents") == [(1,)]


def test_a_sqlite_store_errors_a_line_that_crashed_the_server_each_time(
    tmp_path: Path,
) -> None:
    path = tmp_path / "batches.db"
    process = Store.in_memory()
    store = BatchStore.of(process, path)
    batch_id = new_batch(store, lines=2)
    process.close()
    for attempt in range(1, MAX_LINE_ATTEMPTS + 1):
        process = Store.in_memory()  # the restart after the crash settles the running line
        store = BatchStore.of(process, path)
        assert store.line(batch_id, 0).state == WAITING, attempt
        assert store.mark_running(batch_id, 0)
        process.close()  # and the server dies while it runs
    process = Store.in_memory()
    store = BatchStore.of(process, path)
    assert store.recovered == 1
    assert states(store, batch_id) == [ERRORED, WAITING]
    assert store.line(batch_id, 0).result["body"]["type"] == "error"  # Anthropic's shape
    assert store.line(batch_id, 0).attempts == MAX_LINE_ATTEMPTS
    assert RUNNING not in states(store, batch_id)
    process.close()
