"""Bringing a PostgreSQL key store to this zerohop's schema (`zerohop store migrate`).

Each pending step of `pg_schema.PG_MIGRATIONS` runs in its own transaction, which first takes
one advisory lock: replicas' init containers started together migrate one after the other,
and each later one finds the work done. `zerohop_schema` records every applied step with the
oldest schema version a reader may have to use the store (`MIN_READER`). Every step bumps
`keys_version` and notifies, so running replicas reload their keys.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import psycopg

from zerohop.gateway.store.pg_schema import KEYS_CHANNEL, MIN_READER, PG_MIGRATIONS, SCHEMA_VERSION
from zerohop.gateway.store.postgres import connect
from zerohop.gateway.store.spec import StoreUnavailable

LOCK_ID = 0x7A65_726F_686F_70  # "zerohop": the advisory lock every migrate takes
SCHEMA_TABLE = """
CREATE TABLE IF NOT EXISTS zerohop_schema (
    version int PRIMARY KEY, min_reader int NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(), zerohop text
)"""
# A migrate waits for another one's step, and a step may take longer than a request would.
STEP_TIMEOUTS = "SET LOCAL lock_timeout = '60s'; SET LOCAL statement_timeout = '600s'"


@dataclass(slots=True, frozen=True)
class Migrated:
    applied: list[int]  # the versions this run applied, in order
    version: int  # the store's schema version now


def migrate(url: str) -> Migrated:
    """Apply every pending step; StoreUnavailable where the store cannot be reached."""
    applied = []
    try:
        with connect(url) as conn:
            current = schema_version(conn)
            conn.commit()
            if current >= SCHEMA_VERSION:  # done: no CREATE, so a DML-only role may run it
                return Migrated([], current)
            for version, sql in PG_MIGRATIONS:
                if _apply(conn, version, sql):
                    applied.append(version)
            current = schema_version(conn)
    except psycopg.OperationalError as exc:
        raise StoreUnavailable.wrap(exc, url) from exc
    return Migrated(applied, current)


def _apply(conn: psycopg.Connection, version: int, sql: str) -> bool:
    """Step `version`, unless the store has it: True when this call applied it."""
    with conn.transaction():
        conn.execute(STEP_TIMEOUTS)
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_ID,))
        conn.execute(SCHEMA_TABLE)
        if schema_version(conn) >= version:
            return False
        conn.execute(sql)
        conn.execute(
            "INSERT INTO zerohop_schema (version, min_reader, zerohop) VALUES (%s, %s, %s)",
            (version, MIN_READER[version], metadata.version("zerohop")),
        )
        bumped = _scalar(
            conn,
            "UPDATE store_meta SET value = value + 1 WHERE name = 'keys_version' RETURNING value",
        )
        payload = json.dumps({"v": bumped, "t": time.time()})
        conn.execute("SELECT pg_notify(%s, %s)", (KEYS_CHANNEL, payload))
    return True


def schema_version(conn: psycopg.Connection) -> int:
    """The highest applied step; 0 for a store never migrated."""
    if _scalar(conn, "SELECT to_regclass('zerohop_schema')") is None:
        return 0
    return int(_scalar(conn, "SELECT coalesce(max(version), 0) FROM zerohop_schema"))


def _scalar(conn: psycopg.Connection, sql: str) -> Any:
    """The first column of the one row `sql` always returns."""
    row = conn.execute(sql).fetchone()
    assert row is not None, "the query returns a row"
    return row[0]


def describe(result: Migrated) -> str:
    """What a migrate did, in one line."""
    if result.applied:
        steps = ", ".join(map(str, result.applied))
        return f"applied schema version {steps}: now at version {result.version}"
    if result.version > SCHEMA_VERSION:
        return (
            f"schema version {result.version}, newer than this zerohop's {SCHEMA_VERSION}:"
            " nothing to do"
        )
    return f"schema version {result.version}: up to date"
