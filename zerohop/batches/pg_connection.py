"""The batch tables' SQL on PostgreSQL: a connection that takes SQLite's `?` placeholders and
gives rows read by name or by position, as `sqlite3.Row`s are.

The tables (batch_table, line_table, file_table) write their SQL once, in the subset both
databases read alike. Reads run on a pooled connection in autocommit and return every row at
once, so no connection is held after the call; a transaction (`transaction()`) holds one
connection until it commits, or rolls back on an exception.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from zerohop.gateway.store.postgres import conninfo_options
from zerohop.gateway.store.spec import StoreUnavailable
from zerohop.gateway.store.usage_tables import for_postgres

POOL_MIN, POOL_MAX = 1, 4
POOL_TIMEOUT = 5.0  # seconds a caller waits for a pooled connection


class Row(tuple[Any, ...]):
    """A row's values, also read by column name (`row["tenant"]`, `dict(row)`)."""

    _names: dict[str, int]

    def __new__(cls, values: Sequence[Any], names: dict[str, int]) -> Row:
        row = super().__new__(cls, values)
        row._names = names
        return row

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return tuple.__getitem__(self, self._names[key])
        return tuple.__getitem__(self, key)

    def keys(self) -> list[str]:
        return list(self._names)


class Rows:
    """A statement's outcome, read at once: its rows and the rows it changed."""

    def __init__(self, rows: list[Row], rowcount: int) -> None:
        self._rows, self.rowcount = rows, rowcount

    def fetchone(self) -> Row | None:
        return self._rows[0] if self._rows else None

    def fetchall(self) -> list[Row]:
        return list(self._rows)

    def __iter__(self) -> Iterator[Row]:
        return iter(self._rows)


class Session:
    """Statements on one connection (a transaction's, or an autocommit read's)."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        cursor = self._conn.execute(for_postgres(sql), tuple(params))
        return _read(cursor)

    def executemany(self, sql: str, params: Iterable[Sequence[Any]]) -> Rows:
        with self._conn.cursor() as cursor:
            cursor.executemany(for_postgres(sql), [tuple(p) for p in params])
            return Rows([], cursor.rowcount)


class PgDatabase:
    """A small pool of connections to the fleet store, for the batch tables."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._pool = ConnectionPool(
            url,
            min_size=POOL_MIN,
            max_size=POOL_MAX,
            timeout=POOL_TIMEOUT,
            kwargs={"autocommit": True, **conninfo_options()},
            open=False,
        )
        # Not waiting for a first connection: a replica starts (from its key snapshot) while
        # the store is down, and its batch routes answer 503 until the store is back.
        self._pool.open(wait=False)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        with self._reachable(), self._pool.connection() as conn:
            return Session(conn).execute(sql, params)

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        with self._reachable(), self._pool.connection() as conn, conn.transaction():
            yield Session(conn)

    @contextmanager
    def _reachable(self) -> Iterator[None]:
        """A connection that fails (or none within the pool's timeout) is StoreUnavailable,
        its message one line with the password masked."""
        try:
            yield
        except psycopg.OperationalError as exc:  # PoolTimeout is one too
            raise StoreUnavailable.wrap(exc, self.url) from exc

    def close(self) -> None:
        self._pool.close()


def _read(cursor: psycopg.Cursor) -> Rows:
    if cursor.description is None:
        return Rows([], cursor.rowcount)
    names = {column.name: i for i, column in enumerate(cursor.description)}
    return Rows([Row(values, names) for values in cursor.fetchall()], cursor.rowcount)
