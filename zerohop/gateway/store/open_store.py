"""The store's database, whichever holds it: one SQLite file per replica (`KeyStore`,
`--keys-db`) or a fleet's PostgreSQL (`PostgresStore`, `--store URL`). The CLI uses one
directly; a server opens one per process through `zerohop.gateway.store.store.Store`, whose
typed repositories its consumers receive.

Both read rows back through `store_rows`, so a key or tenant means the same in either, and
both bump a version on every change that a server compares with the one it loaded.
"""

from __future__ import annotations

from typing import Protocol, Unpack

from zerohop.gateway.keys.identity import Budget, Limits, Tenant
from zerohop.gateway.store.response_tables import ResponseRow, StoredResponse
from zerohop.gateway.store.rows import KeyChanges, KeyEntry, KeyRecord, TenantRow
from zerohop.gateway.store.session_tables import SessionCaps, SessionRow
from zerohop.gateway.store.signing_keys import SigningKeyRow
from zerohop.gateway.store.spec import SchemaMismatch, StoreSpec, StoreUnavailable
from zerohop.gateway.store.thread_tables import NewThreadRow, Taken
from zerohop.gateway.store.usage_tables import RefusalRow, UsageRow

__all__ = ["Database", "SchemaMismatch", "StoreSpec", "StoreUnavailable", "open_database"]


class Database(Protocol):
    """Every table of the store, as either backend reads and writes it: tenants and keys
    (the CLI writes them, the server snapshots them), token spend, usage, threads, stored
    responses, console sessions and signing keys."""

    def upsert_tenant(self, tenant: Tenant) -> None: ...

    def tenant(self, name: str) -> Tenant | None: ...

    def tenant_row(self, name: str) -> TenantRow | None: ...

    def tenants(self) -> list[Tenant]: ...

    def tenant_rows(self) -> list[TenantRow]: ...

    def ensure_tenant(self, name: str) -> None: ...

    def create_key(
        self,
        tenant: str,
        *,
        name: str = "",
        expires: float | None = None,
        models: list[str] | None = None,
        priority: str = "interactive",
        limits: Limits = ...,
        budget: Budget | None = None,
        admin: bool = False,
        inference: bool = True,
        created_by: str | None = None,
    ) -> tuple[str, KeyRecord]: ...

    def update_key(self, key_id: str, **fields: Unpack[KeyChanges]) -> KeyRecord: ...

    def revoke_key(self, key_id: str) -> bool: ...

    def key(self, key_id: str) -> KeyRecord | None: ...

    def list_keys(self) -> list[KeyRecord]: ...

    def has_keys(self) -> bool: ...

    def version(self) -> int: ...

    def snapshot(self) -> tuple[int, dict[str, KeyEntry]]: ...

    def spend(self) -> list[tuple[str, str, int]]: ...

    def add_usage(self, usage: list[UsageRow], refusals: list[RefusalRow]) -> None: ...

    def usage(self, width: int, since: int, until: int) -> list[UsageRow]: ...

    def refusals(self, since: int, until: int) -> list[RefusalRow]: ...

    def take_thread(self, tenant: str, message_id: str, now: float, ttl: float) -> Taken: ...

    def put_thread(self, new: NewThreadRow, now: float, ttl: float) -> None: ...

    def release_thread(self, tenant: str, message_id: str, now: float) -> None: ...

    def put_response(self, row: ResponseRow, now: float) -> None: ...

    def get_response(self, tenant: str, response_id: str, now: float) -> StoredResponse | None: ...

    def delete_response(self, tenant: str, response_id: str, now: float) -> bool: ...

    def set_response_status(
        self, tenant: str, response_id: str, status: str, body: str | None, now: float
    ) -> bool: ...

    def create_console_session(self, row: SessionRow, caps: SessionCaps) -> None: ...

    def console_session(
        self, session_sha256: str, now: float, idle: float
    ) -> SessionRow | None: ...

    def touch_console_session(self, session_sha256: str, now: float, every: float) -> bool: ...

    def end_console_session(self, session_sha256: str, now: float) -> bool: ...

    def signing_keys(self, purpose: str) -> list[SigningKeyRow]: ...

    def add_signing_key(self, row: SigningKeyRow) -> bool: ...

    def drop_signing_keys(self, purpose: str, below: int) -> int: ...

    def close(self) -> None: ...

    def describe(self) -> str: ...


def open_database(spec: StoreSpec) -> Database:
    """The database `spec` names, opened: StoreUnavailable where a PostgreSQL store cannot be
    reached or its schema is missing or too old (a SQLite file gets today's schema)."""
    if spec.kind == "postgresql":
        from zerohop.gateway.store.postgres import PostgresStore

        return PostgresStore(spec.url)
    from zerohop.gateway.store.sqlite import KeyStore

    return KeyStore(spec.path)
