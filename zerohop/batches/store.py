"""The batch store: batches, their lines and their files, in SQLite; file contents on disk.

One SQLite file in WAL mode (`batches.db` beside the key store by default) and a folder
beside it for file contents (`batches-files/`), one file per file id. The file is the
process's one store's to open and close (`Store.batch_file`, through `BatchStore.of`): batches
keep a file of their own rather than tables in the keys' file, because their writes (whole
input files as lines, every line's result) must not hold the keys' connection lock, and
operators have `--batches-db` and `batches.db` files already. The store is what makes a batch
survive a restart, SIGTERM or kill -9 alike:

- A batch and all its lines are written in one transaction: a batch exists whole or not at all.
- A line is `waiting`, then `running` while a runner serves it, then finished (`succeeded`,
  `errored`, `canceled` or `expired`) with its result. A finished line is recorded once: a
  second record is refused (`record_result` returns False), so no line is answered twice.
- Opening the store puts every line a crash left `running` back to `waiting`: it is run
  again (its first run never reached the store), unless it was started `MAX_LINE_ATTEMPTS`
  times already: then it is errored, so a line that crashes the server is not run forever.
  Finished lines keep their one result.
- A file's content is written (and fsynced) under a temporary name and renamed before its
  row is committed; contents without a row (a crash in between) are swept at open.

`synchronous=NORMAL` (the default) loses nothing committed when the process is killed; only
an OS crash or power loss can lose the last commits, and then a line at most runs again.

Every read and change of a batch or file takes the tenant, so a key sees only its own
tenant's; `None` (the runner, the finalizer) sees them all. One connection, guarded by the
file's lock: callers on an event loop run these (short) calls with `asyncio.to_thread`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from zerohop.batches.batch_table import BatchTable
from zerohop.batches.records import (
    APIS,
    CANCELED,
    CANCELING,
    DAY,
    ENDED,
    ERRORED,
    EXPIRED,
    FAILED,
    FINISHED,
    IN_PROGRESS,
    LINE_STATES,
    OPEN,
    RUNNING,
    SUCCEEDED,
    WAITING,
    Api,
    BatchNotEnded,
    BatchRecord,
    DuplicateCustomId,
    FileRecord,
    LineRecord,
    NewBatch,
    NewFile,
    NewLine,
    Page,
    RequestCounts,
    StoreError,
    UnknownCursor,
    WaitingLine,
)
from zerohop.batches.schema import SCHEMA, new_batch_id, new_file_id
from zerohop.gateway.store.sqlite_file import SqliteFile
from zerohop.gateway.store.store import Store

if TYPE_CHECKING:
    from zerohop.batches.pg_store import PgBatchStore

__all__ = [
    "APIS", "CANCELED", "CANCELING", "DAY", "ENDED", "ERRORED", "EXPIRED", "FAILED",
    "FINISHED", "IN_PROGRESS", "LINE_STATES", "OPEN", "RUNNING", "SCHEMA", "SUCCEEDED",
    "WAITING", "Api", "BatchNotEnded", "BatchRecord", "BatchStore", "DuplicateCustomId",
    "FileRecord", "LineRecord", "NewBatch", "NewFile", "NewLine", "Page", "RequestCounts",
    "StoreError", "UnknownCursor", "WaitingLine", "new_batch_id", "new_file_id",
]  # fmt: skip


class BatchStore(BatchTable):
    def __init__(self, file: SqliteFile, files_dir: Path | None = None) -> None:
        self.path = file.path
        self.files_dir = files_dir or file.path.with_name(file.path.stem + "-files")
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._lock, self.conn = file.lock, file.conn
        self.recovered = self._recover()  # lines a crash left running, waiting again
        self._sweep_orphans()

    @classmethod
    def of(
        cls, store: Store, path: Path, files_dir: Path | None = None, synchronous: str = "NORMAL"
    ) -> BatchStore:
        """The batches in the SQLite file at `path`, which `store` opens and closes."""
        return cls(store.batch_file(path, SCHEMA, synchronous), files_dir)

    def _recover(self) -> int:
        with self._transaction() as conn:
            return self._settle_abandoned(conn, "1 = 1", (), time.time())

    def renew_leases(self, now: float | None = None) -> int:
        """One process runs this file's lines: there are no leases to renew (see pg_store)."""
        return 0

    def expire_leases(self, now: float | None = None) -> int:
        """Lines a crash left running were settled when the store opened (`_recover`)."""
        return 0

    def _sweep_orphans(self) -> None:
        """Contents without a row: a crash between writing a file and committing its row."""
        with self._lock:
            known = {r[0] for r in self.conn.execute("SELECT id FROM files")}
        for entry in self.files_dir.iterdir():
            if entry.name not in known:
                entry.unlink(missing_ok=True)


# The store the runner and the routes work on: this file's SQLite one (one replica), or the
# fleet's PostgreSQL one (zerohop.batches.pg_store, imported only where a fleet is served).
AnyBatchStore: TypeAlias = "BatchStore | PgBatchStore"
