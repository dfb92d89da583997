"""zerohop.gateway.store.store: the process's one store, on a real SQLite file. Nothing is
opened before a repository is called; every repository shares the one database; a failed
open is tried again by the next call (the calls that waited for it get its error); threads
using the repositories at once never trip over each other's transactions."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from zerohop.gateway.store.open_store import Database
from zerohop.gateway.store.response_tables import ResponseRow
from zerohop.gateway.store.spec import StoreUnavailable
from zerohop.gateway.store.sqlite import KeyStore
from zerohop.gateway.store.store import Store
from zerohop.gateway.store.thread_tables import NewThreadRow
from zerohop.gateway.store.usage_tables import UsageRow

HOUR = 3600.0


class Opener:
    """Opens the SQLite file at `path`, counting the tries; fails while `down`."""

    def __init__(self, path: Path, down: bool = False, delay: float = 0.0) -> None:
        self.path, self.down, self.delay, self.tries = path, down, delay, 0

    def __call__(self) -> Database:
        self.tries += 1
        time.sleep(self.delay)
        if self.down:
            raise StoreUnavailable("the key store: down for the test")
        return KeyStore(self.path)


def test_nothing_is_opened_until_a_repository_is_called_and_then_once(tmp_path: Path) -> None:
    opener = Opener(tmp_path / "keys.db")
    store = Store(opener)
    assert opener.tries == 0 and not (tmp_path / "keys.db").exists()
    assert not store.keys.has_keys()
    store.threads.put(NewThreadRow("msg_1", "acme", "{}", 2, 1), 0.0, HOUR)
    assert store.threads.take("acme", "msg_1", 1.0, HOUR).outcome == "taken"
    assert store.sessions.get("no-such-session", 1.0, HOUR) is None
    assert opener.tries == 1 and store.database() is store.database()
    store.close()
    assert store.keys.version() == 0  # a call after close opens it again
    assert opener.tries == 2
    store.close()


def test_a_failed_open_is_tried_again_by_the_next_call(tmp_path: Path) -> None:
    opener = Opener(tmp_path / "keys.db", down=True)
    store = Store(opener)
    with pytest.raises(StoreUnavailable):
        store.usage.buckets(60, 0, 60)
    opener.down = False
    assert store.usage.buckets(60, 0, 60) == []
    assert opener.tries == 2
    store.close()


def test_calls_waiting_for_a_failed_open_get_its_error(tmp_path: Path) -> None:
    opener = Opener(tmp_path / "keys.db", down=True, delay=0.5)
    store = Store(opener)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            store.keys.version()
        except StoreUnavailable as exc:
            errors.append(exc)

    callers = [threading.Thread(target=call) for _ in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(errors) == 4 and opener.tries == 1
    store.close()


def test_threads_share_the_database_without_a_lock_of_their_own(tmp_path: Path) -> None:
    store = Store(Opener(tmp_path / "keys.db"))
    failures: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(40):
                rid = f"resp_{n}_{i}"
                store.responses.put(ResponseRow(rid, "acme", "completed", "{}", "[]", HOUR), 0.0)
                assert store.responses.get("acme", rid, 1.0) is not None
                store.usage.add([UsageRow(0, f"zh-{n}", "acme", "m", 1)], [])
                store.keys.version()
        except BaseException as exc:  # reported by the assertion below
            failures.append(exc)

    workers = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert failures == []
    assert sum(row.requests for row in store.usage.buckets(60, 0, 60)) == 6 * 40
    store.close()
