"""Where an audit log's chain head is recorded, so that a deleted tail can be told.

The hash chain shows a record deleted or edited in the middle of the log, but not the newest
records removed from its end (or every file removed): what is left is still a whole chain. So
the writer records its chain head (the last record's seq, the SHA-256 of its line, its file
and the time) outside the log directory, in the key store's SQLite file, table
`audit_heads` (one row per audit directory, keyed by its absolute path): at most once a
second while records are written, and at a clean shutdown. `zerohop audit verify` compares
it with the log: a log ending before the recorded head was truncated.

The window: records written after the last recorded head (at most about a second of them)
and then lost in a crash, or deleted, are not reported as truncation; that is the cost of
writing the head once a second instead of once per record.

The row is written with `synchronous=FULL` (one fsync per write, on the audit writer's
thread, never the request path), so it survives power loss as the fsynced log does.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

_T = TypeVar("_T")

TABLE = """
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


class HeadStore:
    """Reads and writes chain heads in one SQLite file; used by one thread at a time."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._conn: sqlite3.Connection | None = None

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(
                self.path, timeout=30.0, isolation_level=None, check_same_thread=False
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.executescript(TABLE)
            self._conn = conn
        return self._conn

    def load(self, directory: Path) -> ChainHead | None:
        return _select(self._connection(), directory)

    def save(self, directory: Path, head: ChainHead) -> None:
        key = directory_key(directory)
        row = (key, head.seq, head.hash, head.file, head.recorded)
        self._connection().execute(_UPSERT, row)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


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


def _select(conn: sqlite3.Connection, directory: Path) -> ChainHead | None:
    row = conn.execute(
        "SELECT seq, hash, file, recorded FROM audit_heads WHERE directory = ?",
        (directory_key(directory),),
    ).fetchone()
    return None if row is None else ChainHead(row[0], row[1], row[2], row[3])


def check_head(head: ChainHead, last_seq: int | None, hash_at_head: str | None) -> str | None:
    """Why the log does not hold `head` (None: it does). `last_seq` is the log's last
    record's seq (None: no records); `hash_at_head` the SHA-256 of its record `head.seq`."""
    where = f"the chain head recorded at {head.describe()}"
    if last_seq is None:
        return f"{where} is missing; the log holds no records"
    if last_seq < head.seq:
        return f"{where} is missing; the log ends at record {last_seq}"
    if hash_at_head is None:
        return f"{where} is missing; the log starts after it and ends at record {last_seq}"
    if hash_at_head != head.hash:
        return f"{where} does not match record {head.seq} of the log (rewritten)"
    return None
