"""Databases for the store tests: one real PostgreSQL per test module (tests/postgres_server.py)
and a fresh database in it per test, so tests share a server but never rows."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator

import psycopg

from tests.postgres_server import PostgresServer, require_postgres
from zerohop.gateway.store.pg_migrations import migrate

_numbers = itertools.count()


def postgres_server() -> Iterator[PostgresServer]:
    """The body of a module-scoped fixture: a server for the module, removed after it."""
    with PostgresServer(require_postgres()) as server:
        yield server


def fresh_database(pg: PostgresServer) -> str:
    """The URL of a new, empty database on `pg`."""
    name = f"t_{os.getpid()}_{next(_numbers)}"
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    base, _, _db = pg.url.rpartition("/")
    return f"{base}/{name}"


def migrated_database(pg: PostgresServer) -> str:
    """The URL of a new database at this zerohop's schema."""
    url = fresh_database(pg)
    migrate(url)
    return url


def with_password(url: str, password: str) -> str:
    """`url` with a password in it (trust authentication ignores it: it only has to stay
    out of every message)."""
    scheme, _, rest = url.partition("://")
    user, _, host = rest.partition("@")
    return f"{scheme}://{user}:{password}@{host}"


def sql(url: str, statement: str) -> list[tuple]:
    """Run one statement as a hand edit would (autocommit); its rows, if any."""
    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(statement)
        return cursor.fetchall() if cursor.description else []


def wait_until(check: Callable[[], bool], timeout: float, step: float = 0.01) -> float:
    """Seconds until `check()` held; AssertionError after `timeout`."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(step)
    return time.monotonic() - start
