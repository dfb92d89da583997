"""The SQLite side of the store: schema, connection, ids, and rows decoded into records."""

from __future__ import annotations

import json
import secrets
import string
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from zerohop.batches.records import Api, BatchRecord, LineRecord, UnknownCursor
from zerohop.gateway.store.sqlite import immediate_transaction

_BASE62 = string.digits + string.ascii_letters

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, tenant TEXT NOT NULL,
    purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at REAL NOT NULL, expires_at REAL, path TEXT NOT NULL  -- in files_dir
);
CREATE INDEX IF NOT EXISTS files_by_tenant ON files (tenant, seq);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, tenant TEXT NOT NULL,
    key_id TEXT NOT NULL, api TEXT NOT NULL CHECK (api IN ('anthropic', 'openai')),
    endpoint TEXT NOT NULL, model TEXT, status TEXT NOT NULL,
    created_at REAL NOT NULL, expires_at REAL NOT NULL, ended_at REAL,
    cancel_initiated_at REAL, expired_at REAL, archived_at REAL,
    completion_window TEXT, input_file_id TEXT, output_file_id TEXT, error_file_id TEXT,
    metadata TEXT, errors TEXT, usage TEXT, identity TEXT
);
CREATE INDEX IF NOT EXISTS batches_by_tenant ON batches (tenant, api, seq);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status, seq);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL REFERENCES batches(id) ON DELETE CASCADE,
    idx INTEGER NOT NULL, custom_id TEXT NOT NULL, params TEXT NOT NULL,
    state TEXT NOT NULL, result TEXT, attempts INTEGER NOT NULL DEFAULT 0,
    started_at REAL, finished_at REAL,
    PRIMARY KEY (batch_id, idx), UNIQUE (batch_id, custom_id)
);
CREATE INDEX IF NOT EXISTS lines_by_state ON lines (batch_id, state, idx);
CREATE INDEX IF NOT EXISTS lines_running ON lines (batch_id) WHERE state = 'running';
"""
_BATCH_COLUMNS = (
    "id, tenant, key_id, api, endpoint, model, status, created_at, expires_at, ended_at,"
    " cancel_initiated_at, expired_at, archived_at, completion_window, input_file_id,"
    " output_file_id, error_file_id, metadata, errors, usage, identity"
)
_LINE_COLUMNS = "batch_id, idx, custom_id, params, state, result, attempts"
_FILE_FIELDS = ("id", "tenant", "purpose", "filename", "bytes", "created_at", "expires_at", "path")
_FILE_COLUMNS = ", ".join(_FILE_FIELDS)

# -- ids -------------------------------------------------------------------------------------


def _base62(n: int) -> str:
    return "".join(secrets.choice(_BASE62) for _ in range(n))


def new_batch_id(api: Api) -> str:
    """Anthropic's `msgbatch_01...` or OpenAI's `batch_...` (as long as theirs)."""
    return "msgbatch_01" + _base62(22) if api == "anthropic" else "batch_" + secrets.token_hex(16)


def new_file_id() -> str:
    return "file-" + _base62(22)


class Statements(Protocol):
    """What the tables run their SQL on: a `sqlite3.Connection`, or the PostgreSQL one of
    zerohop.batches.pg_connection (the same `?` SQL, rows read by name or position)."""

    def execute(self, sql: str, parameters: Sequence[Any] = ..., /) -> Result: ...

    def executemany(self, sql: str, parameters: Iterable[Sequence[Any]], /) -> Result: ...


class Result(Protocol):
    """A statement's outcome: `sqlite3.Cursor`, or pg_connection's `Rows`. A row is a
    `sqlite3.Row` or a `pg_connection.Row`, both read by column name or position; its values
    are the database's, so a row is `Any` and each reader converts the columns it reads."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Connection:
    """One connection guarded by a lock; what each table's methods share. The process's one
    store (zerohop.gateway.store.store.Store) opened it and closes it: a table never does."""

    conn: Any  # Statements
    _lock: threading.RLock

    @contextmanager
    def _transaction(self) -> Iterator[Statements]:
        with self._lock, immediate_transaction(self.conn) as conn:
            yield conn

    def _cursor(self, table: str, tenant: str, object_id: str) -> int:
        with self._lock:
            row = self.conn.execute(
                f"SELECT seq FROM {table} WHERE id = ? AND tenant = ?", (object_id, tenant)
            ).fetchone()
        if row is None:
            raise UnknownCursor(f"no such object to page from: {object_id!r}")
        return int(row[0])


def _owned(row: Any, tenant: str | None) -> bool:
    return tenant is None or row["tenant"] == tenant


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _line(row: Any) -> LineRecord:
    return LineRecord(
        row["batch_id"], row["idx"], row["custom_id"], row["params"], row["state"],
        _loads(row["result"]), row["attempts"],
    )  # fmt: skip


def _batch(row: Any) -> BatchRecord:
    values = dict(row)
    for name in ("metadata", "errors", "usage", "identity"):
        values[name] = _loads(values[name])
    return BatchRecord(**values)
