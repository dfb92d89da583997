"""One function per admin route: read the request, call the service, shape the answer."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from zerohop.admin import wire
from zerohop.admin.budgets import HOUR, budgets_report
from zerohop.admin.context import AdminContext, AdminRequest, checked, invalid, not_found
from zerohop.admin.service import AdminService
from zerohop.admin.usage_report import (
    integer,
    one,
    parse_usage_query,
    refusals_report,
    time_range,
    usage_report,
)
from zerohop.api.load.live_load import LiveLoad
from zerohop.gateway.budgets.sqlite_ledger import BudgetLedger
from zerohop.gateway.keys.identity import Budget
from zerohop.gateway.store.usage_tables import UsageRow

Answer = tuple[int, Any]
Subject = tuple[str, str, Budget]  # (kind, name, budget) of a budget's holder


def _service(admin: AdminContext) -> AdminService:
    if admin.service is None:  # an AdminContext made without one (the console's tests)
        raise not_found("this server does not serve the admin API")
    return admin.service


def _param(req: AdminRequest, name: str) -> str | None:
    """A query parameter given at most once (400 otherwise)."""
    return checked(one, req.query, name)


# -- Anthropic's shapes -----------------------------------------------------------------------


async def list_api_keys(admin: AdminContext, req: AdminRequest) -> Answer:
    limit = checked(_limit, _param(req, "limit"))
    status, tenant = _param(req, "status"), _param(req, "workspace_id")
    if status is not None and status not in wire.LIST_STATUSES:
        raise invalid(f"status must be one of {', '.join(wire.LIST_STATUSES)}, not {status!r}")
    now = time.time()
    ordered = sorted(await _service(admin).keys(), key=lambda r: (-r.created, r.key_id))
    shown = [
        (i, wire.api_key(r, now))
        for i, r in enumerate(ordered)
        if (status is None or wire.key_status(r, now) == status)
        and (tenant is None or r.tenant == tenant)
    ]
    place = {r.key_id: i for i, r in enumerate(ordered)}
    return 200, _page(shown, place, limit, _param(req, "after_id"), _param(req, "before_id"))


def _limit(text: str | None) -> int:
    limit = 20 if text is None else integer(text, "limit")
    if not 1 <= limit <= 1000:
        raise ValueError(f"limit must be 1-1000, not {limit}")
    return limit


def _page(
    shown: list[tuple[int, dict[str, Any]]], place: dict[str, int], limit: int,
    after: str | None, before: str | None,
) -> dict[str, Any]:  # fmt: skip
    """A page of `shown` ((place in the whole list, key)) after or before a cursor key,
    found by its place in the whole list, so a cursor that no longer matches the filter
    (revoked between pages) still pages on, as Anthropic's do."""
    if after is not None and before is not None:
        raise invalid("give after_id or before_id, not both")
    for cursor in (after, before):
        if cursor is not None and cursor not in place:
            raise invalid(f"no API key {cursor!r} to page from")
    if before is not None:
        items = [key for i, key in shown if i < place[before]]
        page = items[-limit:]
    else:
        start = -1 if after is None else place[after]
        items = [key for i, key in shown if i > start]
        page = items[:limit]
    return {
        "data": page,
        "has_more": len(items) > limit,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
    }


async def get_api_key(admin: AdminContext, req: AdminRequest) -> Answer:
    return 200, wire.api_key(await _service(admin).key(req.params["id"]))


async def update_api_key(admin: AdminContext, req: AdminRequest) -> Answer:
    unknown = set(req.body) - {"name", "status"}
    if unknown:  # Anthropic's route: the rest is /v1/admin/keys/{id}
        raise invalid(f"unknown field {sorted(unknown)[0]!r}: this route sets name and status")
    record = await _service(admin).update_key(req.identity, req.params["id"], req.body)
    return 200, wire.api_key(record)


async def messages_usage(admin: AdminContext, req: AdminRequest) -> Answer:
    query = checked(parse_usage_query, req.query)
    service = _service(admin)
    usage = service.usage
    rows = await service.run(
        lambda: usage.buckets(query.width, query.since, query.until, query.by_end_user)
    )
    return 200, usage_report(query, rows)


# -- zerohop's own ----------------------------------------------------------------------------


async def me(admin: AdminContext, req: AdminRequest) -> Answer:
    identity = req.identity
    return 200, {"key_id": identity.key_id, "tenant": identity.tenant.name, "name": identity.name}


async def list_tenants(admin: AdminContext, req: AdminRequest) -> Answer:
    return 200, {"data": await _service(admin).tenants()}


async def get_tenant(admin: AdminContext, req: AdminRequest) -> Answer:
    return 200, await _service(admin).tenant(req.params["name"])


async def put_tenant(admin: AdminContext, req: AdminRequest) -> Answer:
    return 200, await _service(admin).put_tenant(req.identity, req.params["name"], req.body)


async def create_key(admin: AdminContext, req: AdminRequest) -> Answer:
    secret, record = await _service(admin).create_key(req.identity, req.body)
    return 201, {"secret": secret, "api_key": wire.api_key(record)}


async def update_key(admin: AdminContext, req: AdminRequest) -> Answer:
    record = await _service(admin).update_key(req.identity, req.params["id"], req.body)
    return 200, wire.api_key(record)


async def budgets(admin: AdminContext, req: AdminRequest) -> Answer:
    now = time.time()
    minute = int(now // 60 * 60)

    service = _service(admin)

    def read() -> tuple[list[Subject], dict[tuple[str, str], int], list[UsageRow]]:
        keys = service.stored_keys
        subjects = [("key", r.key_id, r.budget) for r in keys.list_keys()
                    if r.budget is not None and wire.key_status(r, now) == "active"]  # fmt: skip
        subjects += [("tenant", t.name, t.budget) for t in keys.tenants() if t.budget]
        spent = {(s, p): t for s, p, t in service.ledger.spend()}
        return subjects, spent, service.usage.buckets(60, minute - HOUR + 60, minute + 60)

    subjects, spent, last_hour = await service.run(read)
    ledger = admin.gateway.ledger
    if isinstance(ledger, BudgetLedger):  # one replica's own ledger: current to the request
        spent |= dict(ledger.spent)  # (a fleet's leases: the store's settled + leased)
    return 200, budgets_report(subjects, spent, last_hour, now)


async def refusals(admin: AdminContext, req: AdminRequest) -> Answer:
    since, until = checked(time_range, req.query, 86400.0)
    service = _service(admin)
    usage = service.usage
    rows = await service.run(lambda: usage.refusals(since, until))
    return 200, refusals_report(rows)


async def audit_search(admin: AdminContext, req: AdminRequest) -> Answer:
    from zerohop.gateway.audit.search import parse_query, search

    log = _audit_log(admin)
    query = checked(parse_query, {k: v[-1] for k, v in req.query.items()})
    page = await asyncio.to_thread(search, log.directory, query, log.include_content)
    return 200, {"data": page.records, "has_more": page.has_more, "next_before": page.next_before}


async def audit_verify(admin: AdminContext, req: AdminRequest) -> Answer:
    from zerohop.gateway.audit.log import verify

    log = _audit_log(admin)

    def check() -> dict[str, Any]:
        result = verify(log.directory, head=log.recorded_head())
        return {"ok": result.ok and result.truncated is None, "records": result.records,
                "files": result.files, "first_broken": result.first_broken,
                "torn": result.torn, "truncated": result.truncated}  # fmt: skip

    return 200, await asyncio.to_thread(check)


def _audit_log(admin: AdminContext) -> Any:
    log = admin.gateway.audit
    if log is None:
        raise not_found("this server keeps no audit log (--no-audit)")
    return log


async def live(admin: AdminContext, req: AdminRequest) -> Answer:
    live = admin.gateway.live
    if not isinstance(live, LiveLoad):  # None, or another observer: no window kept
        raise not_found("live load is not kept on this server")
    seconds = checked(_seconds, _param(req, "seconds"), live)
    since = _param(req, "since")
    since_t = None if since is None else checked(wire.parse_time, since, "since")
    return 200, live.window(seconds, since_t)


def _seconds(text: str | None, live: LiveLoad) -> int:
    capacity = live.capacity
    seconds = capacity if text is None else integer(text, "seconds")
    if not 1 <= seconds <= capacity:
        raise ValueError(f"seconds must be 1-{capacity}, not {seconds}")
    return seconds


async def batches(admin: AdminContext, req: AdminRequest) -> Answer:
    store = admin.batches
    if store is None:
        raise not_found("this server serves no batches")
    limit = checked(_limit, _param(req, "limit"))
    tenant = _param(req, "workspace_id")
    records = await asyncio.to_thread(store.recent_batches, limit, tenant)
    return 200, {"data": [_batch_json(r) for r in records]}


def _batch_json(record: Any) -> dict[str, Any]:
    return {
        "id": record.id, "api": record.api, "workspace_id": record.tenant,
        "api_key_id": record.key_id, "endpoint": record.endpoint, "model": record.model,
        "status": record.status, "created_at": wire.rfc3339(record.created_at),
        "ended_at": wire.rfc3339(record.ended_at), "usage": record.usage,
    }  # fmt: skip


ROUTES = [
    ("GET", "/v1/organizations/api_keys", list_api_keys),
    ("GET", "/v1/organizations/api_keys/{id}", get_api_key),
    ("POST", "/v1/organizations/api_keys/{id}", update_api_key),
    ("GET", "/v1/organizations/usage_report/messages", messages_usage),
    ("GET", "/v1/admin/me", me),
    ("GET", "/v1/admin/tenants", list_tenants),
    ("GET", "/v1/admin/tenants/{name}", get_tenant),
    ("PUT", "/v1/admin/tenants/{name}", put_tenant),
    ("POST", "/v1/admin/keys", create_key),
    ("POST", "/v1/admin/keys/{id}", update_key),
    ("GET", "/v1/admin/budgets", budgets),
    ("GET", "/v1/admin/refusals", refusals),
    ("GET", "/v1/admin/audit", audit_search),
    ("POST", "/v1/admin/audit/verify", audit_verify),
    ("GET", "/v1/admin/live", live),
    ("GET", "/v1/admin/batches", batches),
]
