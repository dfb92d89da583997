"""What the admin routes do: read and change keys and tenants, and audit every change.

The service reads and writes the process's store through its repositories (keys, usage,
the spend ledger), each call in a worker thread, so an admin page never blocks the event
loop. After a change it waits (up to `SETTLE_SECONDS`) until the server serves the store's
new version, so a key revoked here is refused by the very next request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from zerohop.admin import wire
from zerohop.admin.errors import checked, invalid, not_found
from zerohop.api.serving.service import new_request_id
from zerohop.gateway.gateway import Gateway
from zerohop.gateway.keys.identity import Identity, Limits
from zerohop.gateway.store.repositories import KeyRepository, LedgerRepository, UsageRepository
from zerohop.gateway.store.rows import KeyRecord

log = logging.getLogger(__name__)

SETTLE_SECONDS = 3.0
T = TypeVar("T")


class AdminService:
    """Over the store's keys, usage and ledger repositories, for `gateway`'s operators."""

    def __init__(
        self,
        gateway: Gateway,
        keys: KeyRepository,
        usage: UsageRepository,
        ledger: LedgerRepository,
    ) -> None:
        self.gateway = gateway
        self.stored_keys, self.usage, self.ledger = keys, usage, ledger

    @classmethod
    def of(cls, gateway: Gateway) -> AdminService:
        """Over the repositories of `gateway`'s store."""
        store = gateway.store
        return cls(gateway, store.keys, store.usage, store.ledger)

    async def run(self, work: Callable[[], T]) -> T:
        """`work()` (calls of the repositories) on a worker thread."""
        return await asyncio.to_thread(work)

    # -- keys ---------------------------------------------------------------------------------

    async def key(self, key_id: str) -> KeyRecord:
        record = await self.run(lambda: self.stored_keys.key(key_id))
        if record is None:
            raise not_found(f"no API key {key_id!r}")
        return record

    async def keys(self) -> list[KeyRecord]:
        return await self.run(self.stored_keys.list_keys)

    async def create_key(self, actor: Identity, body: dict[str, Any]) -> tuple[str, KeyRecord]:
        allowed = {"tenant", "name", "models", "priority", "expires_at", "limits", "budget",
                   "admin", "inference"}  # fmt: skip
        _known(body, allowed, "key")
        if "tenant" not in body:
            raise invalid("tenant: a key belongs to a tenant; give its name")
        tenant = checked(wire.name_field, body["tenant"], "tenant")
        fields = checked(wire.key_fields, body, Limits())
        fields.setdefault("limits", Limits())
        admin = checked(wire.bool_field, body.get("admin", False), "admin")
        inference = checked(wire.bool_field, body.get("inference", not admin), "inference")
        secret, record = await self.run(
            lambda: self.stored_keys.create_key(
                tenant, admin=admin, inference=inference, created_by=actor.key_id, **fields
            )
        )
        await self._changed(actor, "key.create", record.key_id, None, record, status=201)
        return secret, record

    async def update_key(self, actor: Identity, key_id: str, body: dict[str, Any]) -> KeyRecord:
        allowed = {"name", "status", "models", "priority", "expires_at", "limits", "budget"}
        _known(body, allowed, "key")
        before = await self.key(key_id)
        fields = checked(wire.key_fields, body, before.limits)
        if "status" in body:
            fields |= _status_fields(before, body["status"])
        if not fields:
            return before
        try:
            after = await self.run(lambda: self.stored_keys.update_key(key_id, **fields))
        except KeyError:
            raise not_found(f"no API key {key_id!r}") from None
        await self._changed(actor, "key.update", key_id, before, after)
        return after

    # -- tenants ------------------------------------------------------------------------------

    async def tenants(self) -> list[dict[str, Any]]:
        def read(store: KeyRepository) -> list[dict[str, Any]]:
            active: dict[str, int] = {}
            for record in store.list_keys():
                if wire.key_status(record) == "active":
                    active[record.tenant] = active.get(record.tenant, 0) + 1
            return [wire.tenant_json(r, active.get(r.tenant.name, 0)) for r in store.tenant_rows()]

        return await self.run(lambda: read(self.stored_keys))

    async def tenant(self, name: str) -> dict[str, Any]:
        for tenant in await self.tenants():
            if tenant["name"] == name:
                return tenant
        raise not_found(f"no tenant {name!r}")

    async def put_tenant(self, actor: Identity, name: str, body: dict[str, Any]) -> dict[str, Any]:
        name = checked(wire.name_field, name, "tenant name")
        before = await self.run(lambda: self.stored_keys.tenant(name))
        tenant = checked(wire.tenant_update, body, name, before)
        await self.run(lambda: self.stored_keys.upsert_tenant(tenant))
        await self._changed(actor, "tenant.update", name, before, tenant)
        return await self.tenant(name)

    # -- what every change does ---------------------------------------------------------------

    async def _changed(
        self, actor: Identity, action: str, target: str, before: Any, after: Any, status: int = 200
    ) -> None:
        self.audit(actor, action, target, _shown(before), _shown(after), status)
        version = await self.run(self.stored_keys.version)
        deadline = time.monotonic() + SETTLE_SECONDS
        while self.gateway.auth.version < version and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def audit(
        self, actor: Identity, action: str, target: str, before: Any, after: Any, status: int = 200
    ) -> None:
        log.info("admin: %s %s %s", actor.key_id, action, target)
        audit = self.gateway.audit
        if audit is None:
            return
        audit.record(
            {"kind": "admin", "request_id": new_request_id(), "actor": actor.key_id,
             "tenant": actor.tenant.name, "action": action, "target": target,
             "before": before, "after": after, "status": status}
        )  # fmt: skip


def _shown(value: Any) -> Any:
    """A record or tenant as the audit log keeps it (never a secret: the store has none)."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, KeyRecord):
        return value.as_dict()
    tenant = value
    limits, budget = wire.limits_json(tenant.limits), wire.budget_json(tenant.budget)
    return {"name": tenant.name, "weight": tenant.weight, "limits": limits, "budget": budget}


def _status_fields(record: KeyRecord, status: Any) -> dict[str, Any]:
    if status not in wire.KEY_STATUSES:
        raise invalid(f"status must be one of {', '.join(wire.KEY_STATUSES)}, not {status!r}")
    now = time.time()
    if record.archived is not None and status != "archived":
        raise invalid(f"API key {record.key_id} is archived: it cannot be made {status}")
    if status == "active":
        return {"revoked": None}
    if status == "inactive":
        return {"revoked": record.revoked or now}
    return {"revoked": record.revoked or now, "archived": record.archived or now}


def _known(body: dict[str, Any], allowed: set[str], what: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(f"unknown {what} field {unknown[0]!r} (known: {', '.join(sorted(allowed))})")
