"""The batch store in the PostgreSQL fleet store (`--store postgresql://...`): every replica
reads and writes the same batches, lines and files, so any replica answers any batch id, and a
replica's restart or death loses nothing.

The tables are the SQLite store's (zerohop.gateway.store.batch_schema has their DDL; the same
SQL runs on both through zerohop.batches.pg_connection), with two differences:

- File contents are rows (`file_contents`), written in the transaction that writes the file's
  row: no replica's disk holds them.
- A running line is leased to the replica that started it (`lease_owner`, `lease_until`).
  The runner renews its replica's leases every tick (`renew_leases`), and every replica's
  runner puts the lines whose lease ended back to waiting (`expire_leases`): a dead
  replica's lines run elsewhere after at most the lease TTL. A line started
  `MAX_LINE_ATTEMPTS` times is errored instead. `record_result` still takes the first
  result only, so a line that two replicas happen to run (one was cut off past its lease,
  then came back) gets exactly one result.

Opening the store changes nothing: lines running elsewhere are other replicas' business, and
this replica's own from a previous run end by their leases. The store opens no connection of
its own: it runs on the process store's pool (`PgBatchStore.of(store, ...)`), which the
process store closes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from zerohop.batches.batch_table import BatchTable
from zerohop.batches.pg_connection import PgDatabase, Session
from zerohop.batches.records import RUNNING, WAITING, FileRecord, NewFile
from zerohop.batches.schema import Statements
from zerohop.gateway.store.store import Store

LEASE_TTL = 60.0  # seconds a running line stays leased unrenewed
# FileRecord.path of a file held in the database: a name, never a folder on this host.
IN_DATABASE = Path("fleet-store")


class PgBatchStore(BatchTable):
    _waiting_again = "state = ?, started_at = NULL, lease_owner = NULL, lease_until = NULL"

    def __init__(self, database: PgDatabase, owner: str, lease_ttl: float = LEASE_TTL) -> None:
        self.owner, self.lease_ttl = owner, lease_ttl
        self.files_dir = IN_DATABASE
        # One statement or transaction at a time: the batches take one connection of the
        # pool they share with every repository, never starving those.
        self._lock = threading.RLock()
        self.conn = database
        self.recovered = 0

    @classmethod
    def of(cls, store: Store, owner: str, lease_ttl: float = LEASE_TTL) -> PgBatchStore:
        """The batch tables in `store`'s PostgreSQL database, this replica being `owner`."""
        return cls(PgDatabase.of(store), owner, lease_ttl)

    @contextmanager
    def _transaction(self) -> Iterator[Statements]:
        session: Session
        with self._lock, self.conn.transaction() as session:
            yield session

    def mark_running(self, batch_id: str, index: int, now: float | None = None) -> bool:
        """waiting -> running, leased to this replica; False when another took it first or
        it is no longer waiting."""
        now = time.time() if now is None else now
        with self._transaction() as conn:
            done = conn.execute(
                "UPDATE lines SET state = ?, started_at = ?, attempts = attempts + 1,"
                " lease_owner = ?, lease_until = ? WHERE batch_id = ? AND idx = ? AND state = ?",
                (RUNNING, now, self.owner, now + self.lease_ttl, batch_id, index, WAITING),
            )
        return done.rowcount == 1

    def renew_leases(self, now: float | None = None) -> int:
        """Extend the leases of the lines this replica runs; how many."""
        until = (time.time() if now is None else now) + self.lease_ttl
        with self._transaction() as conn:
            done = conn.execute(
                "UPDATE lines SET lease_until = ? WHERE state = ? AND lease_owner = ?",
                (until, RUNNING, self.owner),
            )
        return done.rowcount

    def expire_leases(self, now: float | None = None) -> int:
        """Lines whose replica stopped renewing: waiting again (or errored); how many."""
        now = time.time() if now is None else now
        with self._transaction() as conn:
            return self._settle_abandoned(conn, "l.lease_until < ?", (now,), now)

    def _write_content(self, file_id: str, content: bytes) -> None:
        pass  # written with the file's row (`_insert_file`)

    def _remove_content(self, file_id: str) -> None:
        pass  # deleted with the file's row (ON DELETE CASCADE)

    def _insert_file(
        self,
        conn: Statements,
        file_id: str,
        tenant: str,
        new: NewFile,
        expires_at: float | None = None,
    ) -> FileRecord:
        record = super()._insert_file(conn, file_id, tenant, new, expires_at)
        conn.execute(
            "INSERT INTO file_contents (id, content) VALUES (?, ?)", (file_id, new.content)
        )
        return record

    def read_file(self, record: FileRecord) -> bytes:
        with self._lock:
            row = self.conn.execute(
                "SELECT content FROM file_contents WHERE id = ?", (record.id,)
            ).fetchone()
        if row is None:
            raise FileNotFoundError(record.id)  # deleted since `file` read its row
        return bytes(row[0])
