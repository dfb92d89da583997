"""The store's typed repositories, one per thing a consumer keeps: keys and tenants, the
spend ledger, usage, message threads, stored responses, console sessions, signing keys.

Each is a view of the process's one database (`zerohop.gateway.store.store.Store`), reached
through `database`, which opens it on first use and again after an open that failed. Every
call blocks (a SQLite file, or a PostgreSQL round trip): consumers make it from a worker
thread, never on the event loop. The backends serialize what needs it (SQLite's connection
lock, PostgreSQL's pool and row locks), so a repository holds no lock of its own. The one
exception is the budget ledger's writer: it gets a SQLite connection of its own to the same
file (`LedgerRepository.writer`; why in `zerohop.gateway.store.ledger_tables`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Unpack

from zerohop.gateway.keys.identity import Tenant
from zerohop.gateway.store.ledger_tables import Durability, LedgerTables
from zerohop.gateway.store.open_store import Database
from zerohop.gateway.store.response_tables import ExpiredResponse, ResponseRow, StoredResponse
from zerohop.gateway.store.rows import KeyChanges, KeyEntry, KeyRecord, NewKey, TenantRow
from zerohop.gateway.store.session_tables import SessionCaps, SessionRow
from zerohop.gateway.store.signing_keys import SigningKeyRow
from zerohop.gateway.store.spec import StoreSpec
from zerohop.gateway.store.thread_tables import NewThreadRow, Taken
from zerohop.gateway.store.usage_tables import RefusalRow, UsageRow

Opener = Callable[[], Database]  # the database, opened on first use (Store.database)
IN_MEMORY = ":memory:"  # a SQLite store of this process's own, no file


class _Repository:
    def __init__(self, database: Opener) -> None:
        self._database = database


class KeyRepository(_Repository):
    """Tenants and API keys: the admin routes change them, the authenticator snapshots them."""

    def upsert_tenant(self, tenant: Tenant) -> None:
        self._database().upsert_tenant(tenant)

    def tenant(self, name: str) -> Tenant | None:
        return self._database().tenant(name)

    def tenants(self) -> list[Tenant]:
        return self._database().tenants()

    def tenant_rows(self) -> list[TenantRow]:
        return self._database().tenant_rows()

    def create_key(self, tenant: str, **fields: Unpack[NewKey]) -> tuple[str, KeyRecord]:
        """A new key: its secret (shown once, never stored) and its record."""
        return self._database().create_key(tenant, **fields)

    def update_key(self, key_id: str, **changes: Unpack[KeyChanges]) -> KeyRecord:
        """The key with `changes` made; KeyError for an unknown key."""
        return self._database().update_key(key_id, **changes)

    def key(self, key_id: str) -> KeyRecord | None:
        return self._database().key(key_id)

    def list_keys(self) -> list[KeyRecord]:
        return self._database().list_keys()

    def has_keys(self) -> bool:
        """Any key at all, revoked ones included."""
        return self._database().has_keys()

    def version(self) -> int:
        """The keys' version, bumped by every change to a key or tenant."""
        return self._database().version()

    def snapshot(self) -> tuple[int, dict[str, KeyEntry]]:
        """(version, secret hash -> the key) as one consistent read."""
        return self._database().snapshot()


class LedgerRepository(_Repository):
    """The token-spend ledger: the reports read it, the budget ledger's writer writes it."""

    def __init__(self, database: Opener, spec: StoreSpec | None = None) -> None:
        super().__init__(database)
        self._spec = spec

    def spend(self) -> list[tuple[str, str, int]]:
        """(subject, period, tokens) of every ledger row, reservations (or leases) included."""
        return self._database().spend()

    def writer(self, durability: Durability) -> LedgerTables:
        """The writer's tables, on a connection of their own to the store's SQLite file
        (why: `ledger_tables`). A PostgreSQL store has none: its budgets are leases."""
        spec = self._spec
        if spec is None or spec.kind != "sqlite" or spec.target == IN_MEMORY:
            where = "this store" if spec is None else spec.describe()
            raise ValueError(
                f"the budget ledger writes a SQLite store's file; {where} has none (a"
                " PostgreSQL store's budgets are leases)"
            )
        return LedgerTables(spec.path, durability)


class UsageRepository(_Repository):
    """Tokens and refusals per minute, key, tenant and model."""

    def add(self, usage: list[UsageRow], refusals: list[RefusalRow]) -> None:
        """Add these counts to the stored ones (in one transaction)."""
        self._database().add_usage(usage, refusals)

    def buckets(
        self, width: int, since: int, until: int, by_end_user: bool = False
    ) -> list[UsageRow]:
        """The counts summed per `width` seconds from `since` to `until` (unix seconds);
        `by_end_user`: split by a trusted front's end user ("" the rest), summing the same."""
        return self._database().usage(width, since, until, by_end_user)

    def refusals(self, since: int, until: int) -> list[RefusalRow]:
        """The refusals summed per reason, key and tenant, with the last message of each."""
        return self._database().refusals(since, until)


class ThreadRepository(_Repository):
    """The Anthropic surface's message threads (zerohop.gateway.store.thread_tables)."""

    def take(self, tenant: str, message_id: str, now: float, ttl: float) -> Taken:
        return self._database().take_thread(tenant, message_id, now, ttl)

    def put(self, new: NewThreadRow, now: float, ttl: float) -> None:
        self._database().put_thread(new, now, ttl)

    def release(self, tenant: str, message_id: str, now: float) -> None:
        self._database().release_thread(tenant, message_id, now)


class ResponseRepository(_Repository):
    """The Responses API's stored responses (zerohop.gateway.store.response_tables)."""

    def put(self, row: ResponseRow, now: float) -> None:
        self._database().put_response(row, now)

    def get(self, tenant: str, response_id: str, now: float) -> StoredResponse | None:
        return self._database().get_response(tenant, response_id, now)

    def delete(self, tenant: str, response_id: str, now: float) -> bool:
        return self._database().delete_response(tenant, response_id, now)

    def set_status(
        self, tenant: str, response_id: str, status: str, body: str | None, now: float
    ) -> bool:
        return self._database().set_response_status(tenant, response_id, status, body, now)

    def renew_leases(self, owner: str, until: float, now: float) -> list[str]:
        return self._database().renew_response_leases(owner, until, now)

    def release_lease(self, response_id: str) -> None:
        self._database().release_response_lease(response_id)

    def expired(self, now: float) -> list[ExpiredResponse]:
        return self._database().expired_responses(now)


class SessionRepository(_Repository):
    """The operators' console sessions (zerohop.gateway.store.session_tables)."""

    def create(self, row: SessionRow, caps: SessionCaps) -> None:
        self._database().create_console_session(row, caps)

    def get(self, session_sha256: str, now: float, idle: float) -> SessionRow | None:
        return self._database().console_session(session_sha256, now, idle)

    def touch(self, session_sha256: str, now: float, every: float) -> bool:
        return self._database().touch_console_session(session_sha256, now, every)

    def end(self, session_sha256: str, now: float) -> bool:
        return self._database().end_console_session(session_sha256, now)


class SigningKeyRepository(_Repository):
    """The server's own signing keys per purpose (zerohop.gateway.store.signing_keys)."""

    def keys(self, purpose: str) -> list[SigningKeyRow]:
        return self._database().signing_keys(purpose)

    def add(self, row: SigningKeyRow) -> bool:
        return self._database().add_signing_key(row)

    def drop(self, purpose: str, below: int) -> int:
        return self._database().drop_signing_keys(purpose, below)
