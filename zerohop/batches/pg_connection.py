"""The batch tables' SQL on PostgreSQL: a connection that takes SQLite's `?` placeholders and
gives rows read by name or by position, as `sqlite3.Row`s are.

The tables (batch_table, line_table, file_table) write their SQL once, in the subset both
databases read alike. The connections are the process store's (`Store.postgres_pool`, whose
pool serves every repository): the batches open none of their own and close none. A read
runs on a pooled connection, committed as it goes back, and returns every row at once, so
no connection is held after the call; a transaction (`transaction()`) holds one connection
until it commits, or rolls back on an exception.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from psycopg_pool import ConnectionPool

from zerohop.gateway.store.spec import StoreUnavailable
from zerohop.gateway.store.store import Store
from zerohop.gateway.store.usage_tables import for_postgres


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
    """Statements on one connection (a transaction's, or a single statement's). Its cursors
    read tuples, whatever rows the pool's connections give by default."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        with self._conn.cursor(row_factory=tuple_row) as cursor:
            cursor.execute(for_postgres(sql), tuple(params))
            return _read(cursor)

    def executemany(self, sql: str, params: Iterable[Sequence[Any]]) -> Rows:
        with self._conn.cursor(row_factory=tuple_row) as cursor:
            cursor.executemany(for_postgres(sql), [tuple(p) for p in params])
            return Rows([], cursor.rowcount)


class PgDatabase:
    """The batch tables' statements, on connections of the process store's pool."""

    def __init__(self, pool: Callable[[], ConnectionPool]) -> None:
        # Asked for at each call, not once: a replica starts (from its key snapshot) while
        # the store is down, and its batch routes answer 503 until the store opens.
        self.pool = pool

    @classmethod
    def of(cls, store: Store) -> PgDatabase:
        """The tables in `store`'s PostgreSQL database (TypeError from a call on SQLite)."""
        return cls(store.postgres_pool)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        with self._connection() as conn:
            return Session(conn).execute(sql, params)

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        with self._connection() as conn, conn.transaction():
            yield Session(conn)

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection; one that fails (or none within the pool's timeout) is
        StoreUnavailable, its message one line with the password masked."""
        pool = self.pool()  # StoreUnavailable while the store cannot be opened
        try:
            with pool.connection() as conn:
                yield conn
        except psycopg.OperationalError as exc:  # PoolTimeout is one too
            url = pool.conninfo if isinstance(pool.conninfo, str) else ""
            raise StoreUnavailable.wrap(exc, url) from exc


def _read(cursor: psycopg.Cursor[Any]) -> Rows:
    if cursor.description is None:
        return Rows([], cursor.rowcount)
    names = {column.name: i for i, column in enumerate(cursor.description)}
    return Rows([Row(values, names) for values in cursor.fetchall()], cursor.rowcount)
