"""The batch store on real SQLite files, and the same tests on the PostgreSQL fleet store
(zerohop.batches.pg_store, a real server): batches whole or not at all, each line answered
once, a crash (an abandoned connection, a SIGKILLed process) resumes where it was, each key's
tenant sees only its own batches and files."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from zerohop.batches.store import (
    CANCELED,
    CANCELING,
    ENDED,
    ERRORED,
    EXPIRED,
    FAILED,
    IN_PROGRESS,
    RUNNING,
    SUCCEEDED,
    WAITING,
    BatchNotEnded,
    BatchStore,
    DuplicateCustomId,
    NewBatch,
    NewFile,
    NewLine,
    RequestCounts,
    UnknownCursor,
    new_batch_id,
    new_file_id,
)
from zerohop.gateway.store.spec import StoreSpec
from zerohop.gateway.store.store import Store

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BatchStore]:
    """A batch store on its process's one store, which closes it."""
    opened: BatchStore
    if request.param == "sqlite":
        process = Store.in_memory()
        opened = BatchStore.of(process, tmp_path / "batches.db")
    else:
        from tests.pg_fixtures import migrated_database
        from zerohop.batches.pg_store import PgBatchStore

        url = migrated_database(request.getfixturevalue("postgres"))
        process = Store.of(StoreSpec.parse(url))
        opened = PgBatchStore.of(process, owner="replica-a")  # type: ignore[assignment]
    yield opened
    process.close()


def stored_contents(store: BatchStore) -> set[str]:
    """The ids of the files whose contents the store holds (on disk, or in PostgreSQL)."""
    if store.files_dir.is_dir():
        return {p.name for p in store.files_dir.iterdir()}
    return {row[0] for row in store.conn.execute("SELECT id FROM file_contents")}


def new_batch(
    store: BatchStore, tenant: str = "acme", lines: int = 3, api: str = "anthropic", **fields
) -> str:
    endpoint = "/v1/messages" if api == "anthropic" else "/v1/chat/completions"
    spec = NewBatch(tenant, f"zh-{tenant}", api, endpoint, model="tiny", **fields)
    requests = [NewLine(f"{tenant}-{i}", {"max_tokens": 8, "n": i}) for i in range(lines)]
    return store.create_batch(spec, requests).id


def states(store: BatchStore, batch_id: str) -> list[str]:
    return [line.state for line in store.lines(batch_id)]


def test_ids_look_like_the_apis_ids() -> None:
    assert re.fullmatch(r"msgbatch_01[0-9A-Za-z]{22}", new_batch_id("anthropic"))
    assert re.fullmatch(r"batch_[0-9a-f]{32}", new_batch_id("openai"))
    assert re.fullmatch(r"file-[0-9A-Za-z]{22}", new_file_id())
    assert new_file_id() != new_file_id()


def test_a_batch_is_created_with_all_its_lines(store: BatchStore) -> None:
    refused = NewLine("other-model", {"model": "x"}, ERRORED, {"type": "errored"})
    spec = NewBatch("acme", "zh-acme", "anthropic", "/v1/messages", metadata={"k": "v"})
    batch = store.create_batch(spec, [NewLine("a", '{"max_tokens": 1}'), refused])
    assert batch.status == IN_PROGRESS and batch.open
    assert batch.expires_at == pytest.approx(batch.created_at + 24 * 3600)
    assert batch.metadata == {"k": "v"}
    assert store.counts(batch.id) == RequestCounts(waiting=1, errored=1)
    first, second = store.lines(batch.id)
    assert (first.custom_id, first.params, first.state) == ("a", '{"max_tokens": 1}', WAITING)
    assert (second.state, second.result) == (ERRORED, {"type": "errored"})


def test_a_duplicate_custom_id_refuses_the_whole_batch(store: BatchStore) -> None:
    lines = [NewLine("a", {}), NewLine("b", {}), NewLine("a", {})]
    with pytest.raises(DuplicateCustomId) as refused:
        store.create_batch(NewBatch("acme", "zh-acme", "anthropic", "/v1/messages"), lines)
    assert refused.value.custom_id == "a"
    assert store.list_batches("acme", "anthropic").data == []
    assert store.tenant_line_counts() == {}


def test_a_batch_with_validation_errors_is_failed_at_once(store: BatchStore) -> None:
    errors = [{"code": "invalid_json_line", "line": 2, "message": "not JSON", "param": None}]
    spec = NewBatch("acme", "zh-acme", "openai", "/v1/chat/completions", errors=errors)
    batch = store.create_batch(spec, [])
    assert (batch.status, batch.errors, batch.open) == (FAILED, errors, False)
    assert batch.ended_at == batch.created_at
    assert store.next_waiting(10) == []


def test_a_line_is_answered_once(store: BatchStore) -> None:
    batch_id = new_batch(store)
    assert store.mark_running(batch_id, 0)
    assert not store.mark_running(batch_id, 0)  # running already
    assert store.record_result(batch_id, 0, SUCCEEDED, {"message": {"id": "msg_1"}})
    assert not store.record_result(batch_id, 0, ERRORED, {"error": "again"})
    assert not store.mark_running(batch_id, 0)
    assert store.line(batch_id, 0).result == {"message": {"id": "msg_1"}}
    assert store.line(batch_id, 0).attempts == 1
    assert store.record_result(batch_id, 1, ERRORED, {"error": "key revoked"})  # never ran
    with pytest.raises(ValueError):
        store.record_result(batch_id, 2, RUNNING, None)
    assert store.counts(batch_id) == RequestCounts(waiting=1, succeeded=1, errored=1)


def test_requeue_gives_a_running_line_back(store: BatchStore) -> None:
    batch_id = new_batch(store, lines=1)
    assert store.mark_running(batch_id, 0)
    assert store.requeue(batch_id, 0)
    assert not store.requeue(batch_id, 0)
    assert states(store, batch_id) == [WAITING]
    assert store.mark_running(batch_id, 0)
    assert store.line(batch_id, 0).attempts == 2


def test_next_waiting_takes_tenants_in_turn(store: BatchStore) -> None:
    acme_old = new_batch(store, "acme", lines=3)
    new_batch(store, "acme", lines=2)
    globex = new_batch(store, "globex", lines=2, api="openai")
    taken = store.next_waiting(5)
    assert [w.tenant for w in taken] == ["acme", "globex", "acme", "globex", "acme"]
    assert [w.line.custom_id for w in taken if w.tenant == "acme"] == [
        "acme-0", "acme-1", "acme-2",
    ]  # fmt: skip
    assert taken[1].endpoint == "/v1/chat/completions" and taken[1].key_id == "zh-globex"
    # The tenant with fewer running lines comes first; a backed-off tenant is skipped.
    store.mark_running(acme_old, 0)
    assert store.next_waiting(1)[0].tenant == "globex"
    store.mark_running(globex, 0)
    store.mark_running(globex, 1)
    assert [w.tenant for w in store.next_waiting(3)] == ["acme"] * 3
    assert store.next_waiting(3, exclude=["acme"]) == []


def test_cancel_cancels_waiting_lines_and_the_batch_ends_when_running_ones_finish(
    store: BatchStore,
) -> None:
    batch_id = new_batch(store, lines=3)
    store.mark_running(batch_id, 0)
    store.record_result(batch_id, 1, SUCCEEDED, {"ok": True})
    canceled = store.cancel_batch("acme", batch_id, now=123.0)
    assert (canceled.status, canceled.cancel_initiated_at) == (CANCELING, 123.0)
    assert states(store, batch_id) == [RUNNING, SUCCEEDED, CANCELED]
    assert store.cancel_batch("acme", batch_id).cancel_initiated_at == 123.0  # once
    assert store.next_waiting(10) == []
    assert store.finish_batch(batch_id) is None  # a line still runs
    assert store.record_result(batch_id, 0, CANCELED, None)
    ended = store.finish_batch(batch_id, output=NewFile("results.jsonl", b'{"a":1}\n'))
    assert (ended.status, ended.error_file_id) == (ENDED, None)
    output = store.file("acme", ended.output_file_id)
    assert (output.purpose, store.read_file(output)) == ("batch_output", b'{"a":1}\n')
    assert store.finish_batch(batch_id) is None  # ended already
    assert store.cancel_batch("acme", batch_id).status == ENDED


def test_finish_refused_writes_no_file(store: BatchStore) -> None:
    batch_id = new_batch(store, lines=1)
    assert store.finish_batch(batch_id, output=NewFile("out.jsonl", b"x")) is None
    assert stored_contents(store) == set()


def test_expired_batches_expire_their_waiting_lines(store: BatchStore) -> None:
    due = new_batch(store, lines=3, created_at=1000.0, expires_in=10.0)
    later = new_batch(store, lines=1)
    store.mark_running(due, 0)
    store.record_result(due, 1, SUCCEEDED, {})
    assert store.expire_due(now=1010.0) == [due]
    assert store.expire_due(now=1011.0) == []
    assert states(store, due) == [RUNNING, SUCCEEDED, EXPIRED]
    assert store.batch(None, due).expired_at == 1010.0
    assert states(store, later) == [WAITING]
    store.record_result(due, 0, SUCCEEDED, {})
    assert store.finish_batch(due).status == ENDED


def test_lists_page_by_id_newest_first(store: BatchStore) -> None:
    ids = [new_batch(store, lines=1) for _ in range(5)]  # oldest first
    new_batch(store, "globex", lines=1)
    new_batch(store, lines=1, api="openai")
    first = store.list_batches("acme", "anthropic", limit=2)
    assert [b.id for b in first.data] == [ids[4], ids[3]] and first.has_more
    assert (first.first_id, first.last_id) == (ids[4], ids[3])
    second = store.list_batches("acme", "anthropic", limit=2, after_id=first.last_id)
    assert [b.id for b in second.data] == [ids[2], ids[1]] and second.has_more
    last = store.list_batches("acme", "anthropic", limit=2, after_id=second.last_id)
    assert [b.id for b in last.data] == [ids[0]] and not last.has_more
    back = store.list_batches("acme", "anthropic", limit=2, before_id=ids[0])
    assert [b.id for b in back.data] == [ids[2], ids[1]] and back.has_more
    newest = store.list_batches("acme", "anthropic", limit=2, before_id=ids[2])
    assert [b.id for b in newest.data] == [ids[4], ids[3]] and not newest.has_more
    assert len(store.list_batches("acme", "openai").data) == 1
    other = store.list_batches("globex", "anthropic").data[0].id
    with pytest.raises(UnknownCursor):
        store.list_batches("acme", "anthropic", after_id=other)


def test_a_tenant_sees_and_changes_only_its_own_batches(store: BatchStore) -> None:
    batch_id = new_batch(store, "acme", lines=1)
    assert store.batch("globex", batch_id) is None
    assert store.cancel_batch("globex", batch_id) is None
    assert not store.delete_batch("globex", batch_id)
    assert store.batch("acme", batch_id).status == IN_PROGRESS
    assert store.batch(None, batch_id) is not None  # the runner sees every tenant's


def test_delete_needs_an_ended_batch_and_removes_its_outputs(store: BatchStore) -> None:
    batch_id = new_batch(store, lines=1)
    with pytest.raises(BatchNotEnded):
        store.delete_batch("acme", batch_id)
    store.cancel_batch("acme", batch_id)
    ended = store.finish_batch(
        batch_id, output=NewFile("out.jsonl", b"o"), error=NewFile("err.jsonl", b"e")
    )
    outputs = {ended.output_file_id, ended.error_file_id}
    assert outputs <= stored_contents(store)
    assert store.delete_batch("acme", batch_id)
    assert store.batch("acme", batch_id) is None and store.lines(batch_id) == []
    assert not outputs & stored_contents(store)
    assert store.file("acme", ended.output_file_id) is None


def test_files_keep_their_contents(store: BatchStore, tmp_path: Path) -> None:
    record = store.put_file("acme", "batch", "input.jsonl", b'{"custom_id": "a"}\n')
    if isinstance(store.conn, sqlite3.Connection):  # beside the database
        assert record.path.parent == tmp_path / "batches-files"
    assert (record.bytes, record.filename, record.purpose) == (19, "input.jsonl", "batch")
    assert store.read_file(store.file("acme", record.id)) == b'{"custom_id": "a"}\n'
    assert store.file("globex", record.id) is None
    assert not store.delete_file("globex", record.id)
    other = store.put_file("acme", "user_data", "notes.txt", b"n")
    newest = store.list_files("acme")
    assert [f.id for f in newest.data] == [other.id, record.id] and not newest.has_more
    oldest = store.list_files("acme", order="asc", limit=1)
    assert [f.id for f in oldest.data] == [record.id] and oldest.has_more
    rest = store.list_files("acme", order="asc", after=record.id)
    assert [f.id for f in rest.data] == [other.id]
    assert [f.id for f in store.list_files("acme", purpose="batch").data] == [record.id]
    assert store.list_files("globex").data == []
    assert store.delete_file("acme", record.id)
    assert store.file("acme", record.id) is None and record.id not in stored_contents(store)
    assert not store.delete_file("acme", record.id)


def test_tenant_line_counts(store: BatchStore) -> None:
    acme = new_batch(store, "acme", lines=2)
    new_batch(store, "globex", lines=1)
    store.mark_running(acme, 0)
    store.record_result(acme, 1, SUCCEEDED, {})
    counts = store.tenant_line_counts()
    assert counts == {
        "acme": RequestCounts(running=1, succeeded=1),
        "globex": RequestCounts(waiting=1),
    }


def test_lines_page_through_a_batch(store: BatchStore) -> None:
    batch_id = new_batch(store, lines=5)
    first = store.lines(batch_id, limit=2)
    rest = store.lines(batch_id, after=first[-1].index, limit=10)
    assert [line.index for line in first + rest] == [0, 1, 2, 3, 4]


def test_reopening_after_a_crash_runs_running_lines_again(tmp_path: Path) -> None:
    crashed_process = Store.in_memory()
    crashed = BatchStore.of(crashed_process, tmp_path / "batches.db")
    batch_id = new_batch(crashed, lines=4)
    for index in (0, 1, 2):
        crashed.mark_running(batch_id, index)
    crashed.record_result(batch_id, 0, SUCCEEDED, {"message": {"id": "msg_0"}})
    # No close, no cleanup: the next process opens the file as the crash left it.
    process = Store.in_memory()
    reopened = BatchStore.of(process, tmp_path / "batches.db")
    assert reopened.recovered == 2
    assert states(reopened, batch_id) == [SUCCEEDED, WAITING, WAITING, WAITING]
    assert reopened.line(batch_id, 0).result == {"message": {"id": "msg_0"}}
    assert not reopened.record_result(batch_id, 0, ERRORED, {})
    assert [w.line.index for w in reopened.next_waiting(10)] == [1, 2, 3]
    assert reopened.line(batch_id, 1).attempts == 1  # the lost run is counted
    process.close()
    crashed_process.close()


CHILD = """
import os, signal, sys
from collections.abc import Iterator
from pathlib import Path
from zerohop.batches.store import BatchStore, NewBatch, NewLine
from zerohop.gateway.store.store import Store
store = BatchStore.of(Store.in_memory(), Path(sys.argv[1]))
spec = NewBatch("acme", "zh-acme", "openai", "/v1/chat/completions", model="tiny")
batch = store.create_batch(spec, [NewLine(f"r{i}", {"i": i}) for i in range(3)])
print(batch.id, flush=True)
store.mark_running(batch.id, 0)
store.record_result(batch.id, 0, "succeeded", {"status_code": 200})
store.mark_running(batch.id, 1)
(store.files_dir / ".file-half-written.tmp").write_bytes(b"partial")
(store.files_dir / "file-nobodyknows").write_bytes(b"orphan")
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_sigkilled_process_resumes_where_it_was(tmp_path: Path) -> None:
    db = tmp_path / "batches.db"
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(db)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    batch_id = child.stdout.strip()
    process = Store.in_memory()
    store = BatchStore.of(process, db)
    assert store.recovered == 1
    assert states(store, batch_id) == [SUCCEEDED, WAITING, WAITING]
    assert store.line(batch_id, 0).result == {"status_code": 200}
    assert list(store.files_dir.iterdir()) == []  # unfinished and unknown contents swept
    process.close()
