"""Where an audit log's chain head is recorded, so that a deleted tail can be told.

The hash chain shows a record deleted or edited in the middle of the log, but not the newest
records removed from its end (or every file removed): what is left is still a whole chain. So
the writer records its chain head (the last record's seq, the SHA-256 of its line, its file
and the time) outside the log directory, in table `audit_heads` of a SQLite file (one row per
audit directory, keyed by its absolute path): at most once a second while records are
written, and at a clean shutdown. `zerohop audit verify` compares it with the log: a log
ending before the recorded head was truncated.

The file is the replica's own: the key store's file with a SQLite store (the row is written on
the store's one connection), and the replica's local `--keys-db` file on a PostgreSQL fleet.
A head guards a log on this host's disk, and `zerohop audit verify` reads it offline on that
host (or on a copy of its data folder), so it never goes to the fleet's database.

The window: records written after the last recorded head (at most about a second of them)
and then lost in a crash, or deleted, are not reported as truncation; that is the cost of
writing the head once a second instead of once per record. The row is written with
`synchronous=FULL` (one fsync per write, on the audit writer's thread, never the request
path), so it survives power loss as the fsynced log does.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

_T = TypeVar("_T")

SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS audit_heads (
    directory TEXT PRIMARY KEY, seq INTEGER NOT NULL, hash TEXT NOT NULL,
    file TEXT NOT NULL, recorded REAL NOT NULL
);
"""
_UPSERT = (
    "INSERT INTO audit_heads (directory, seq, hash, file, recorded) VALUES (?, ?, ?, ?, ?)"
    " ON CONFLICT(directory) DO UPDATE SET seq=excluded.seq, hash=excluded.hash,"
    " file=excluded.file, recorded=excluded.recorded"
)

# The heads' SQLite connection, held for one call (the store's, under its lock).
Connection = Callable[[], AbstractContextManager[sqlite3.Connection]]


@dataclass(frozen=True, slots=True)
class ChainHead:
    seq: int  # the last record's seq
    hash: str  # hex SHA-256 of its line (the next record's prev)
    file: str  # the file it was written to, as named then
    recorded: float  # when this head was recorded (Unix time)

    def describe(self) -> str:
        stamp = datetime.fromtimestamp(self.recorded, UTC).isoformat(timespec="seconds")
        return f"{stamp.replace('+00:00', 'Z')} (record {self.seq}, hash {self.hash})"


def directory_key(directory: Path) -> str:
    return str(Path(directory).resolve())


class AuditHeadRepository:
    """The chain heads of this replica's audit logs, read and written from any thread."""

    def __init__(self, connection: Connection, where: str) -> None:
        self._connection, self.where = connection, where

    def load(self, directory: Path) -> ChainHead | None:
        with self._connection() as conn:
            return _select(conn, directory)

    def save(self, directory: Path, head: ChainHead) -> None:
        row = (directory_key(directory), head.seq, head.hash, head.file, head.recorded)
        with self._connection() as conn:
            conn.execute(_UPSERT, row)


def read_head(db: Path, directory: Path) -> ChainHead | None:
    """The head recorded for `directory` in `db`, opened read-only (nothing is created);
    None when the file, the table or the row is not there."""
    return read_heads(db, lambda conn: _select(conn, directory))


def read_heads(db: Path, query: Callable[[sqlite3.Connection], _T]) -> _T | None:
    """`query` on `db` opened read-only; None when the file or the heads table is missing."""
    if not Path(db).is_file():
        return None
    conn = sqlite3.connect(f"{Path(db).resolve().as_uri()}?mode=ro", uri=True)
    try:
        return query(conn)
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return None
        raise
    finally:
        conn.close()


def only_head(db: Path) -> tuple[str, ChainHead] | None:
    """(directory, head) when `db` records exactly one audit folder's head, else None."""
    query = "SELECT directory, seq, hash, file, recorded FROM audit_heads LIMIT 2"
    rows = read_heads(db, lambda conn: conn.execute(query).fetchall())
    if rows is None or len(rows) != 1:
        return None
    where, seq, hash_, file, recorded = rows[0]
    return where, ChainHead(seq, hash_, file, recorded)


def _select(conn: sqlite3.Connection, directory: Path) -> ChainHead | None:
    row = conn.execute(
        "SELECT seq, hash, file, recorded FROM audit_heads WHERE directory = ?",
        (directory_key(directory),),
    ).fetchone()
    return None if row is None else ChainHead(row[0], row[1], row[2], row[3])
