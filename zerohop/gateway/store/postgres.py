"""The key store in PostgreSQL (`--store postgresql://...`): one set of keys for a fleet.

The same methods as the SQLite `KeyStore`, over a small connection pool. Every change is one
transaction that first bumps `store_meta.keys_version` (its row lock serializes writers, so
versions commit in order), stamps the rows it writes with that version (`change_version`),
and sends `NOTIFY zerohop_keys` (delivered on commit only) for the replicas' key feeds
(`zerohop.gateway.store.pg_key_feed`), which read the keys back with `read_keys`.

`connect` and `conninfo_options` are for every PostgreSQL connection zerohop opens: a
connection attempt gives up after 2 s, TCP keepalives notice a dead peer in about 9 s, and
no statement waits more than 2 s (a lock, 1 s), so a partition is noticed in seconds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Unpack

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from zerohop.gateway.keys.identity import Tenant
from zerohop.gateway.store.pg_schema import KEYS_CHANNEL, SCHEMA_VERSION
from zerohop.gateway.store.response_tables import (
    ExpiredResponse,
    ResponseRow,
    ResponseTables,
    StoredResponse,
)
from zerohop.gateway.store.rows import (
    KeyChanges,
    KeyEntry,
    KeyRecord,
    KeyRows,
    NewKey,
    TenantRow,
    key_record,
    key_values,
    tenant_row,
)
from zerohop.gateway.store.session_tables import SessionCaps, SessionRow, SessionTables
from zerohop.gateway.store.signing_keys import SigningKeyRow, SigningKeyTables
from zerohop.gateway.store.spec import SchemaMismatch, StoreUnavailable, mask_password
from zerohop.gateway.store.sqlite import (
    KEY_ID_LENGTH,
    LIMIT_COLUMNS,
    TenantReads,
    budget_values,
    hash_secret,
    key_columns,
    new_key,
)
from zerohop.gateway.store.thread_tables import NewThreadRow, Taken, ThreadTables
from zerohop.gateway.store.usage_tables import RefusalRow, UsageRow, UsageTables

# The process's one pool (store.Store): its repositories, which had 6, and the batch tables,
# which had a pool of 4 of their own and now take one connection at a time here (their
# store's lock); 8 keeps the repositories' 6 free while batches write, with one to spare.
POOL_MIN, POOL_MAX = 1, 8
POOL_TIMEOUT = 2.0  # seconds a caller waits for a pooled connection
MIGRATE_HINT = "run `zerohop store migrate`"

_LIMIT_SQL = ", ".join(LIMIT_COLUMNS)
_BUMP = "UPDATE store_meta SET value = value + 1 WHERE name = 'keys_version' RETURNING value"
_VERSION = "SELECT value FROM store_meta WHERE name = 'keys_version'"
_UPSERT_TENANT = (
    f"INSERT INTO tenants (name, weight, {_LIMIT_SQL}, budget_tokens, budget_period, created,"
    f" change_version) VALUES ({', '.join(['%s'] * (len(LIMIT_COLUMNS) + 6))})"
    " ON CONFLICT (name) DO UPDATE SET weight = excluded.weight,"
    f" {', '.join(f'{c} = excluded.{c}' for c in LIMIT_COLUMNS)},"
    " budget_tokens = excluded.budget_tokens, budget_period = excluded.budget_period,"
    " change_version = excluded.change_version"
)
_ENSURE_TENANT = (
    "INSERT INTO tenants (name, created, change_version) VALUES (%s, %s, %s)"
    " ON CONFLICT (name) DO NOTHING"
)
_INSERT_KEY = (
    "INSERT INTO keys (key_id, secret_sha256, tenant, name, created, expires, models,"
    f" priority, {_LIMIT_SQL}, budget_tokens, budget_period, admin, inference, created_by,"
    f" change_version) VALUES ({', '.join(['%s'] * (len(LIMIT_COLUMNS) + 14))})"
)
_USAGE = UsageTables(postgres=True)
_THREADS = ThreadTables(postgres=True)
_RESPONSES = ResponseTables(postgres=True)
_SESSIONS = SessionTables(postgres=True)
_SIGNING_KEYS = SigningKeyTables(postgres=True)
# Ordered as SQLite orders text (bytewise), whatever the database's collation.
_TENANTS = 'SELECT * FROM tenants ORDER BY name COLLATE "C"'
_KEYS = 'SELECT * FROM keys ORDER BY tenant COLLATE "C", created'


def conninfo_options() -> dict[str, Any]:
    """Connection parameters on top of the URL's: fail fast, notice a dead peer in seconds."""
    return {
        "connect_timeout": 2,
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 2,
        "options": "-c statement_timeout=2000 -c lock_timeout=1000",
    }


def connect(url: str, *, autocommit: bool = False, **extra: Any) -> psycopg.Connection:
    """A connection of its own (tuple rows) with `conninfo_options`; `extra` adds to them
    (application_name=...)."""
    return psycopg.connect(url, autocommit=autocommit, **(conninfo_options() | extra))


def check_schema(conn: psycopg.Connection, where: str) -> int:
    """The store's schema version; SchemaMismatch unless this zerohop may serve on it."""
    if _one(conn, "SELECT to_regclass('zerohop_schema') AS t")["t"] is None:
        raise SchemaMismatch(f"the key store {where} has no zerohop schema: {MIGRATE_HINT}")
    row = _first(conn, "SELECT version, min_reader FROM zerohop_schema ORDER BY version DESC")
    version = 0 if row is None else row["version"]
    if row is None or version < SCHEMA_VERSION:
        raise SchemaMismatch(
            f"the key store {where} has schema version {version} and this zerohop needs"
            f" {SCHEMA_VERSION}: {MIGRATE_HINT}"
        )
    if row["min_reader"] > SCHEMA_VERSION:
        raise SchemaMismatch(
            f"the key store {where} has schema version {version}, which zerohop reads from"
            f" schema version {row['min_reader']} on; this zerohop has {SCHEMA_VERSION}:"
            " upgrade zerohop"
        )
    return version


def keys_version(conn: psycopg.Connection) -> int:
    return int(_one(conn, _VERSION)["value"])


def read_keys(conn: psycopg.Connection) -> tuple[int, dict[str, KeyEntry], bool]:
    """(version, secret hash -> Identity or InvalidKey of every key not revoked and
    RevokedKey of every revoked one, whether any key exists at all), as one consistent read."""
    rows = read_key_rows(conn)
    return rows.version, rows.index(), rows.has_keys


def read_key_rows(conn: psycopg.Connection) -> KeyRows:
    """Every tenant and key row with the keys_version they are at, as one consistent read."""
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        version = keys_version(conn)
        return KeyRows(version, _all(conn, _TENANTS), _all(conn, "SELECT * FROM keys"))


class PostgresStore(TenantReads):
    """Reads and writes keys and tenants in PostgreSQL; the `Store` of a fleet."""

    def __init__(self, url: str) -> None:
        self.url = url
        with self._errors(), connect(url) as conn:
            check_schema(conn, self.describe())
        self.pool = ConnectionPool(
            url,
            min_size=POOL_MIN,
            max_size=POOL_MAX,
            timeout=POOL_TIMEOUT,
            kwargs=conninfo_options() | {"row_factory": dict_row},
            check=ConnectionPool.check_connection,
            open=False,
            name="zerohop-store",
        )
        self.pool.open(wait=False)

    def close(self) -> None:
        self.pool.close()

    def describe(self) -> str:
        return mask_password(self.url)

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except psycopg.OperationalError as exc:  # PoolTimeout is one too
            raise StoreUnavailable.wrap(exc, self.url) from exc

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection]:
        with self._errors(), self.pool.connection() as conn:
            yield conn

    @contextmanager
    def _change(self) -> Iterator[tuple[psycopg.Connection, int]]:
        """One transaction: bump the version, let the caller write its rows stamped with it,
        tell the listeners (on commit)."""
        with self._connection() as conn, conn.transaction():
            version = _one(conn, _BUMP)["value"]
            yield conn, version
            payload = json.dumps({"v": version, "t": time.time()})
            conn.execute("SELECT pg_notify(%s, %s)", (KEYS_CHANNEL, payload))

    def _all(self, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        with self._connection() as conn:
            return _all(conn, sql, params)

    # -- tenants ------------------------------------------------------------------------------

    def upsert_tenant(self, tenant: Tenant) -> None:
        with self._change() as (conn, version):
            conn.execute(
                _UPSERT_TENANT,
                (tenant.name, tenant.weight, *tenant.limits.values(),
                 *budget_values(tenant.budget), time.time(), version),
            )  # fmt: skip

    def tenant_row(self, name: str) -> TenantRow | None:
        rows = self._all("SELECT * FROM tenants WHERE name = %s", (name,))
        return tenant_row(rows[0]) if rows else None

    def tenant_rows(self) -> list[TenantRow]:
        return [tenant_row(r) for r in self._all(_TENANTS)]

    def ensure_tenant(self, name: str) -> None:
        with self._change() as (conn, version):
            conn.execute(_ENSURE_TENANT, (name, time.time(), version))

    # -- keys ---------------------------------------------------------------------------------

    def create_key(self, tenant: str, **fields: Unpack[NewKey]) -> tuple[str, KeyRecord]:
        """A new key (and its tenant if new), in one change: the secret and its record."""
        key = new_key()
        key_id = key[:KEY_ID_LENGTH]
        with self._change() as (conn, version):
            now = time.time()
            conn.execute(_ENSURE_TENANT, (tenant, now, version))
            conn.execute(
                _INSERT_KEY,
                (key_id, hash_secret(key), tenant, fields.get("name", ""), now,
                 *key_values(fields), version),
            )  # fmt: skip
        record = self.key(key_id)
        assert record is not None
        return key, record

    def update_key(self, key_id: str, **fields: Unpack[KeyChanges]) -> KeyRecord:
        """Change some of: tenant, name, expires, models, priority, limits, budget."""
        if self.key(key_id) is None:
            raise KeyError(key_id)
        columns = key_columns(fields)
        if columns:
            assignments = ", ".join(f"{c} = %s" for c in columns)
            with self._change() as (conn, version):
                if "tenant" in columns:
                    conn.execute(_ENSURE_TENANT, (columns["tenant"], time.time(), version))
                conn.execute(
                    f"UPDATE keys SET {assignments}, change_version = %s WHERE key_id = %s",
                    (*columns.values(), version, key_id),
                )
        updated = self.key(key_id)
        assert updated is not None
        return updated

    def revoke_key(self, key_id: str) -> bool:
        with self._change() as (conn, version):
            done = conn.execute(
                "UPDATE keys SET revoked = %s, change_version = %s"
                " WHERE key_id = %s AND revoked IS NULL",
                (time.time(), version, key_id),
            )
        return done.rowcount == 1

    def key(self, key_id: str) -> KeyRecord | None:
        rows = self._all("SELECT * FROM keys WHERE key_id = %s", (key_id,))
        return key_record(rows[0]) if rows else None

    def list_keys(self) -> list[KeyRecord]:
        return [key_record(r) for r in self._all(_KEYS)]

    # -- what the server loads ----------------------------------------------------------------

    def has_keys(self) -> bool:
        """Any key at all, revoked ones included: the store is in use, the server is not open."""
        return bool(self._all("SELECT 1 FROM keys LIMIT 1"))

    def version(self) -> int:
        with self._connection() as conn:
            return keys_version(conn)

    def snapshot(self) -> tuple[int, dict[str, KeyEntry]]:
        """(version, secret hash -> Identity) of every key that is not revoked; a key whose
        row or tenant row holds an invalid value maps to an InvalidKey instead, a revoked
        key to a RevokedKey (refused, named in the audit)."""
        with self._connection() as conn:
            version, index, _has_keys = read_keys(conn)
        return version, index

    def add_usage(self, usage: list[UsageRow], refusals: list[RefusalRow]) -> None:
        with self._connection() as conn, conn.transaction():
            _USAGE.write(conn.cursor(), usage, refusals)

    def usage(
        self, width: int, since: int, until: int, by_end_user: bool = False
    ) -> list[UsageRow]:
        with self._connection() as conn:
            cursor = conn.cursor(row_factory=dict_row)
            return _USAGE.usage(cursor, width, since, until, by_end_user)

    def refusals(self, since: int, until: int) -> list[RefusalRow]:
        with self._connection() as conn:
            return _USAGE.refusal_totals(conn.cursor(row_factory=dict_row), since, until)

    # -- message threads (zerohop.gateway.store.thread_tables) ------------------------------

    def take_thread(self, tenant: str, message_id: str, now: float, ttl: float) -> Taken:
        with self._connection() as conn, conn.transaction():
            return _THREADS.take(conn.cursor(row_factory=dict_row), tenant, message_id, now, ttl)

    def put_thread(self, new: NewThreadRow, now: float, ttl: float) -> None:
        with self._connection() as conn, conn.transaction():
            _THREADS.put(conn.cursor(), new, now, ttl)

    def release_thread(self, tenant: str, message_id: str, now: float) -> None:
        with self._connection() as conn, conn.transaction():
            _THREADS.release(conn.cursor(), tenant, message_id, now)

    # -- stored responses (zerohop.gateway.store.response_tables) ---------------------------

    def put_response(self, row: ResponseRow, now: float) -> None:
        with self._connection() as conn, conn.transaction():
            _RESPONSES.put(conn.cursor(), row, now)

    def get_response(self, tenant: str, response_id: str, now: float) -> StoredResponse | None:
        with self._connection() as conn, conn.transaction():
            cur = conn.cursor(row_factory=dict_row)
            return _RESPONSES.get(cur, tenant, response_id, now)

    def delete_response(self, tenant: str, response_id: str, now: float) -> bool:
        with self._connection() as conn, conn.transaction():
            return _RESPONSES.delete(conn.cursor(), tenant, response_id, now)

    def set_response_status(
        self, tenant: str, response_id: str, status: str, body: str | None, now: float
    ) -> bool:
        with self._connection() as conn, conn.transaction():
            return _RESPONSES.set_status(conn.cursor(), tenant, response_id, status, body, now)

    def renew_response_leases(self, owner: str, until: float, now: float) -> list[str]:
        with self._connection() as conn, conn.transaction():
            return _RESPONSES.renew(conn.cursor(), owner, until, now)

    def release_response_lease(self, response_id: str) -> None:
        with self._connection() as conn, conn.transaction():
            _RESPONSES.release(conn.cursor(), response_id)

    def expired_responses(self, now: float) -> list[ExpiredResponse]:
        with self._connection() as conn, conn.transaction():
            return _RESPONSES.expired(conn.cursor(), now)

    # -- console sessions (zerohop.gateway.store.session_tables) ----------------------------

    def create_console_session(self, row: SessionRow, caps: SessionCaps) -> None:
        with self._connection() as conn, conn.transaction():
            _SESSIONS.create(conn.cursor(row_factory=dict_row), row, caps)

    def console_session(self, session_sha256: str, now: float, idle: float) -> SessionRow | None:
        with self._connection() as conn, conn.transaction():
            return _SESSIONS.get(conn.cursor(row_factory=dict_row), session_sha256, now, idle)

    def touch_console_session(self, session_sha256: str, now: float, every: float) -> bool:
        with self._connection() as conn, conn.transaction():
            return _SESSIONS.touch(conn.cursor(), session_sha256, now, every)

    def end_console_session(self, session_sha256: str, now: float) -> bool:
        with self._connection() as conn, conn.transaction():
            return _SESSIONS.revoke(conn.cursor(), session_sha256, now)

    # -- signing keys (zerohop.gateway.store.signing_keys) ----------------------------------

    def signing_keys(self, purpose: str) -> list[SigningKeyRow]:
        with self._connection() as conn:
            return _SIGNING_KEYS.keys(conn.cursor(row_factory=dict_row), purpose)

    def add_signing_key(self, row: SigningKeyRow) -> bool:
        with self._connection() as conn, conn.transaction():
            return _SIGNING_KEYS.add(conn.cursor(), row)

    def drop_signing_keys(self, purpose: str, below: int) -> int:
        with self._connection() as conn, conn.transaction():
            return _SIGNING_KEYS.drop(conn.cursor(), purpose, below)

    def spend(self) -> list[tuple[str, str, int]]:
        """(subject, period, tokens) of the fleet: settled plus leased to replicas."""
        rows = self._all(
            "SELECT subject, period, settled + leased AS tokens FROM budget_state"
            ' ORDER BY subject COLLATE "C", period COLLATE "C"'
        )
        return [(r["subject"], r["period"], int(r["tokens"])) for r in rows]


def _all(conn: psycopg.Connection, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    return conn.cursor(row_factory=dict_row).execute(sql, params).fetchall()


def _first(
    conn: psycopg.Connection, sql: str, params: tuple[Any, ...] = ()
) -> dict[str, Any] | None:
    """The query's first row, or None when it has none."""
    return conn.cursor(row_factory=dict_row).execute(sql, params).fetchone()


def _one(conn: psycopg.Connection, sql: str, params: tuple[Any, ...] = ()) -> dict[str, Any]:
    """The one row a query always returns (an aggregate, RETURNING, to_regclass)."""
    row = _first(conn, sql, params)
    assert row is not None, "the query returns a row"
    return row
