"""The key store: tenants and API keys in SQLite, and the token-spend ledger beside them.

One file (`--keys-db`, default `$XDG_DATA_HOME/zerohop/keys.db`) shared by the server and
the `zerohop keys` CLI. Secrets are never stored: a key is `zh-` + 32 random bytes
(URL-safe base64) and the store keeps its SHA-256. The key id is the key's first 11
characters, public, shown in logs and the audit trail. Every change to keys or tenants bumps
`meta.keys_version`, which the server polls to reload its in-memory index.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Unpack

from zerohop.gateway.keys.identity import LIMIT_NAMES, Budget, Limits, Tenant
from zerohop.gateway.store import audit_heads
from zerohop.gateway.store import response_tables as response_sql
from zerohop.gateway.store import session_tables as session_sql
from zerohop.gateway.store import signing_keys as signing_sql
from zerohop.gateway.store import thread_tables as thread_sql
from zerohop.gateway.store import usage_tables as usage_sql
from zerohop.gateway.store.response_tables import ExpiredResponse, ResponseRow, StoredResponse
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
from zerohop.gateway.store.session_tables import SessionCaps, SessionRow
from zerohop.gateway.store.signing_keys import SigningKeyRow
from zerohop.gateway.store.thread_tables import NewThreadRow, Taken
from zerohop.gateway.store.usage_tables import RefusalRow, UsageRow

KEY_PREFIX = "zh-"
KEY_ID_LENGTH = len(KEY_PREFIX) + 8
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('keys_version', 0);
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY, weight REAL NOT NULL DEFAULT 1.0,
    rpm INTEGER, itpm INTEGER, otpm INTEGER, max_concurrency INTEGER,
    budget_tokens INTEGER, budget_period TEXT, created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS keys (
    key_id TEXT PRIMARY KEY, secret_sha256 TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL REFERENCES tenants(name), name TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL, expires REAL, revoked REAL,
    models TEXT NOT NULL DEFAULT '[]', priority TEXT NOT NULL DEFAULT 'interactive',
    rpm INTEGER, itpm INTEGER, otpm INTEGER, max_concurrency INTEGER,
    budget_tokens INTEGER, budget_period TEXT,
    admin INTEGER NOT NULL DEFAULT 0, inference INTEGER NOT NULL DEFAULT 1,
    archived REAL, created_by TEXT
);
CREATE TABLE IF NOT EXISTS spend (
    subject TEXT NOT NULL, period TEXT NOT NULL, tokens INTEGER NOT NULL,
    PRIMARY KEY (subject, period)
);
CREATE TABLE IF NOT EXISTS reservations (
    request_id TEXT PRIMARY KEY, charges TEXT NOT NULL, created REAL NOT NULL
);
"""
# Columns added to `keys` after its first release: a file made before gets them on open.
ADDED_KEY_COLUMNS = (
    ("admin", "INTEGER NOT NULL DEFAULT 0"),
    ("inference", "INTEGER NOT NULL DEFAULT 1"),
    ("archived", "REAL"),
    ("created_by", "TEXT"),
)
LIMIT_COLUMNS = LIMIT_NAMES  # the limit columns of `tenants` and `keys` (SCHEMA spells them)
_LIMIT_SQL = ", ".join(LIMIT_COLUMNS)
_UPSERT_TENANT = (
    f"INSERT INTO tenants (name, weight, {_LIMIT_SQL}, budget_tokens, budget_period, created)"
    f" VALUES ({','.join('?' * (len(LIMIT_COLUMNS) + 5))})"
    " ON CONFLICT(name) DO UPDATE SET weight=excluded.weight,"
    f" {', '.join(f'{c}=excluded.{c}' for c in LIMIT_COLUMNS)},"
    " budget_tokens=excluded.budget_tokens, budget_period=excluded.budget_period"
)
_INSERT_KEY = (
    "INSERT INTO keys (key_id, secret_sha256, tenant, name, created, expires, models,"
    f" priority, {_LIMIT_SQL}, budget_tokens, budget_period, admin, inference, created_by)"
    f" VALUES ({','.join('?' * (len(LIMIT_COLUMNS) + 13))})"
)
NO_LIMITS = Limits()
_USAGE = usage_sql.UsageTables(postgres=False)
_THREADS = thread_sql.ThreadTables(postgres=False)
_RESPONSES = response_sql.ResponseTables(postgres=False)
_SESSIONS = session_sql.SessionTables(postgres=False)
_SIGNING_KEYS = signing_sql.SigningKeyTables(postgres=False)


def default_db_path() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "zerohop" / "keys.db"


def hash_secret(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def connect(path: Path, synchronous: str = "FULL") -> sqlite3.Connection:
    """The store in WAL mode. `synchronous`: FULL (the key store's own changes, rare: a
    revoked key stays revoked across power loss) fsyncs every commit; NORMAL loses nothing
    committed when the process is killed, only on an OS crash or power loss (the budget
    ledger's `--durability normal`)."""
    schema = (
        SCHEMA
        + usage_sql.SQLITE_SCHEMA
        + thread_sql.SQLITE_SCHEMA
        + response_sql.SQLITE_SCHEMA
        + session_sql.SQLITE_SCHEMA
        + signing_sql.SQLITE_SCHEMA
        + audit_heads.SQLITE_SCHEMA
    )
    conn = open_wal(path, schema, synchronous)
    _add_key_columns(conn)
    return conn


def _add_key_columns(conn: sqlite3.Connection) -> None:
    have = {row[1] for row in conn.execute("PRAGMA table_info(keys)")}
    if all(column in have for column, _ in ADDED_KEY_COLUMNS):
        return
    with immediate_transaction(conn):
        have = {row[1] for row in conn.execute("PRAGMA table_info(keys)")}  # under the lock
        for column, decl in ADDED_KEY_COLUMNS:
            if column not in have:
                conn.execute(f"ALTER TABLE keys ADD COLUMN {column} {decl}")


@contextmanager
def immediate_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT on a connection opened by `open_wal`; ROLLBACK on any
    exception, which is raised on."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def open_wal(path: Path, schema: str, synchronous: str) -> sqlite3.Connection:
    """A SQLite file in WAL mode with foreign keys on and `schema` applied; transactions are
    explicit (`BEGIN IMMEDIATE`), and the connection may be shared by threads under a lock."""
    assert synchronous in ("NORMAL", "FULL"), synchronous
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.executescript(schema)
    return conn


class TenantReads:
    """What both stores derive from their `tenant_row` and `tenant_rows`."""

    def tenant_row(self, name: str) -> TenantRow | None:
        raise NotImplementedError

    def tenant_rows(self) -> list[TenantRow]:
        raise NotImplementedError

    def tenant(self, name: str) -> Tenant | None:
        """The tenant (an invalid field of its row read as a placeholder: see tenant_row)."""
        row = self.tenant_row(name)
        return None if row is None else row.tenant

    def tenants(self) -> list[Tenant]:
        return [r.tenant for r in self.tenant_rows()]


class KeyStore(TenantReads):
    """Reads and writes keys and tenants (the CLI), and snapshots them (the server). One
    connection, shared by the threads of the process's repositories (`store.Store`) one call
    at a time: a transaction on it holds the lock, as does a read (which would otherwise see
    another thread's transaction half done)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.conn = connect(path)
        self._lock = threading.RLock()

    def close(self) -> None:
        with self._lock:
            self.conn.close()

    def describe(self) -> str:
        return str(self.path)

    @contextmanager
    def _change(self) -> Iterator[sqlite3.Connection]:
        with self._transaction() as conn:
            yield conn
            conn.execute("UPDATE meta SET value = value + 1 WHERE name = 'keys_version'")

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock, immediate_transaction(self.conn) as conn:
            yield conn

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self.conn

    def locked(self) -> AbstractContextManager[sqlite3.Connection]:
        """The connection, held for one call of a repository whose SQL is its own module's
        (zerohop.gateway.store.audit_heads); a statement outside a transaction commits."""
        return self._read()

    # -- tenants ------------------------------------------------------------------------------

    def upsert_tenant(self, tenant: Tenant) -> None:
        with self._change() as conn:
            conn.execute(
                _UPSERT_TENANT,
                (tenant.name, tenant.weight, *tenant.limits.values(),
                 *budget_values(tenant.budget), time.time()),
            )  # fmt: skip

    def tenant_row(self, name: str) -> TenantRow | None:
        """The tenant and the invalid fields of its row (`zerohop.gateway.store.rows`)."""
        with self._read() as conn:
            row = conn.execute("SELECT * FROM tenants WHERE name = ?", (name,)).fetchone()
        return None if row is None else tenant_row(row)

    def tenant_rows(self) -> list[TenantRow]:
        with self._read() as conn:
            rows = conn.execute("SELECT * FROM tenants ORDER BY name").fetchall()
        return [tenant_row(r) for r in rows]

    def ensure_tenant(self, name: str) -> None:
        with self._change() as conn:
            conn.execute(
                "INSERT OR IGNORE INTO tenants (name, created) VALUES (?, ?)", (name, time.time())
            )

    # -- keys ---------------------------------------------------------------------------------

    def create_key(self, tenant: str, **fields: Unpack[NewKey]) -> tuple[str, KeyRecord]:
        """A new key: returns the secret (shown once, never stored) and its record."""
        self.ensure_tenant(tenant)
        key = new_key()
        key_id = key[:KEY_ID_LENGTH]
        with self._change() as conn:
            conn.execute(
                _INSERT_KEY,
                (key_id, hash_secret(key), tenant, fields.get("name", ""), time.time(),
                 *key_values(fields)),
            )  # fmt: skip
        record = self.key(key_id)
        assert record is not None
        return key, record

    def update_key(self, key_id: str, **fields: Unpack[KeyChanges]) -> KeyRecord:
        """Change some of: tenant, name, expires, models, priority, limits, budget, admin,
        inference, revoked, archived."""
        record = self.key(key_id)
        if record is None:
            raise KeyError(key_id)
        columns = key_columns(fields)
        if "tenant" in columns:
            self.ensure_tenant(columns["tenant"])
        if columns:
            assignments = ", ".join(f"{c} = ?" for c in columns)
            with self._change() as conn:
                conn.execute(
                    f"UPDATE keys SET {assignments} WHERE key_id = ?", (*columns.values(), key_id)
                )
        updated = self.key(key_id)
        assert updated is not None
        return updated

    def revoke_key(self, key_id: str) -> bool:
        with self._change() as conn:
            done = conn.execute(
                "UPDATE keys SET revoked = ? WHERE key_id = ? AND revoked IS NULL",
                (time.time(), key_id),
            )
        return done.rowcount == 1

    def key(self, key_id: str) -> KeyRecord | None:
        with self._read() as conn:
            row = conn.execute("SELECT * FROM keys WHERE key_id = ?", (key_id,)).fetchone()
        return None if row is None else key_record(row)

    def list_keys(self) -> list[KeyRecord]:
        with self._read() as conn:
            rows = conn.execute("SELECT * FROM keys ORDER BY tenant, created").fetchall()
        return [key_record(r) for r in rows]

    # -- what the server loads ----------------------------------------------------------------

    def has_keys(self) -> bool:
        """Any key at all, revoked ones included: the store is in use, the server is not open."""
        with self._read() as conn:
            return conn.execute("SELECT 1 FROM keys LIMIT 1").fetchone() is not None

    def version(self) -> int:
        with self._read() as conn:
            row = conn.execute("SELECT value FROM meta WHERE name = 'keys_version'").fetchone()
        return int(row[0])

    def snapshot(self) -> tuple[int, dict[str, KeyEntry]]:
        """(version, secret hash -> Identity) of every key that is not revoked; a key whose
        row or tenant row holds an invalid value maps to an InvalidKey instead, a revoked
        key to a RevokedKey (refused, named in the audit)."""
        with self._transaction() as conn:
            version = self.version()
            tenants = [dict(r) for r in conn.execute("SELECT * FROM tenants")]
            keys = [dict(r) for r in conn.execute("SELECT * FROM keys")]
        return version, KeyRows(version, tenants, keys).index()

    def spend(self) -> list[tuple[str, str, int]]:
        """(subject, period, tokens) of every ledger row, reservations included."""
        with self._read() as conn:
            rows = conn.execute("SELECT subject, period, tokens FROM spend ORDER BY 1, 2")
            return [(r[0], r[1], r[2]) for r in rows]

    # -- usage (zerohop.gateway.store.usage_tables) ------------------------------------

    def add_usage(self, usage: list[UsageRow], refusals: list[RefusalRow]) -> None:
        with self._transaction() as conn:
            _USAGE.write(conn, usage, refusals)

    def usage(
        self, width: int, since: int, until: int, by_end_user: bool = False
    ) -> list[UsageRow]:
        with self._read() as conn:
            return _USAGE.usage(conn, width, since, until, by_end_user)

    def refusals(self, since: int, until: int) -> list[RefusalRow]:
        with self._read() as conn:
            return _USAGE.refusal_totals(conn, since, until)

    # -- message threads (zerohop.gateway.store.thread_tables) ------------------------------

    def take_thread(self, tenant: str, message_id: str, now: float, ttl: float) -> Taken:
        with self._transaction() as conn:
            return _THREADS.take(conn, tenant, message_id, now, ttl)

    def put_thread(self, new: NewThreadRow, now: float, ttl: float) -> None:
        with self._transaction() as conn:
            _THREADS.put(conn, new, now, ttl)

    def release_thread(self, tenant: str, message_id: str, now: float) -> None:
        with self._transaction() as conn:
            _THREADS.release(conn, tenant, message_id, now)

    # -- stored responses (zerohop.gateway.store.response_tables) ---------------------------

    def put_response(self, row: ResponseRow, now: float) -> None:
        with self._transaction() as conn:
            _RESPONSES.put(conn, row, now)

    def get_response(self, tenant: str, response_id: str, now: float) -> StoredResponse | None:
        with self._read() as conn:
            return _RESPONSES.get(conn, tenant, response_id, now)

    def delete_response(self, tenant: str, response_id: str, now: float) -> bool:
        with self._transaction() as conn:
            return _RESPONSES.delete(conn, tenant, response_id, now)

    def set_response_status(
        self, tenant: str, response_id: str, status: str, body: str | None, now: float
    ) -> bool:
        with self._transaction() as conn:
            return _RESPONSES.set_status(conn, tenant, response_id, status, body, now)

    def renew_response_leases(self, owner: str, until: float, now: float) -> list[str]:
        with self._transaction() as conn:
            return _RESPONSES.renew(conn, owner, until, now)

    def release_response_lease(self, response_id: str) -> None:
        with self._transaction() as conn:
            _RESPONSES.release(conn, response_id)

    def expired_responses(self, now: float) -> list[ExpiredResponse]:
        with self._transaction() as conn:
            return _RESPONSES.expired(conn, now)

    # -- console sessions (zerohop.gateway.store.session_tables) ----------------------------

    def create_console_session(self, row: SessionRow, caps: SessionCaps) -> None:
        with self._transaction() as conn:
            _SESSIONS.create(conn, row, caps)

    def console_session(self, session_sha256: str, now: float, idle: float) -> SessionRow | None:
        with self._read() as conn:
            return _SESSIONS.get(conn, session_sha256, now, idle)

    def touch_console_session(self, session_sha256: str, now: float, every: float) -> bool:
        with self._transaction() as conn:
            return _SESSIONS.touch(conn, session_sha256, now, every)

    def end_console_session(self, session_sha256: str, now: float) -> bool:
        with self._transaction() as conn:
            return _SESSIONS.revoke(conn, session_sha256, now)

    # -- signing keys (zerohop.gateway.store.signing_keys) ----------------------------------

    def signing_keys(self, purpose: str) -> list[SigningKeyRow]:
        with self._read() as conn:
            return _SIGNING_KEYS.keys(conn, purpose)

    def add_signing_key(self, row: SigningKeyRow) -> bool:
        with self._transaction() as conn:
            return _SIGNING_KEYS.add(conn, row)

    def drop_signing_keys(self, purpose: str, below: int) -> int:
        with self._transaction() as conn:
            return _SIGNING_KEYS.drop(conn, purpose, below)


SqliteStore = KeyStore  # the Database (zerohop.gateway.store.open_store) of one replica's own file


def key_columns(changes: KeyChanges) -> dict[str, Any]:
    """The `keys` columns (and values) that `update_key(**fields)` sets, in either store."""
    fields: Mapping[str, Any] = changes
    plain = ("tenant", "name", "expires", "priority", "revoked", "archived")
    columns = {k: fields[k] for k in plain if k in fields}
    columns |= {k: int(fields[k]) for k in ("admin", "inference") if k in fields}
    if "models" in fields:
        columns["models"] = json.dumps(fields["models"] or [])
    if "limits" in fields:
        columns |= dict(zip(LIMIT_COLUMNS, fields["limits"].values(), strict=True))
    if "budget" in fields:
        tokens, period = budget_values(fields["budget"])
        columns |= {"budget_tokens": tokens, "budget_period": period}
    return columns


def budget_values(budget: Budget | None) -> tuple[int | None, str | None]:
    return (None, None) if budget is None else (budget.tokens, budget.period)
