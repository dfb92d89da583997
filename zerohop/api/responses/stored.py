"""Stored responses (`store: true`, the API's default), in the key store
(`zerohop.gateway.store.response_tables`: SQLite per replica, or the fleet's PostgreSQL, so
that any replica answers any id).

Decisions where the API leaves room:
- A response belongs to the tenant of the key that created it (every key of the tenant may
  read, continue, list or delete it). Another tenant's id, an unknown one and an expired
  one are the same 404: nothing tells them apart.
- Kept `ttl_s` (default 30 days, as the API keeps them) from its creation.
- A row holds the response object as GET returns it and the items it saw before its output
  (those its `previous_response_id` chain gave it, then its own input): a continue reads
  one row, whatever the chain's length. A response whose items and body exceed `max_bytes`
  (default 16 MiB) is answered and not kept.
- The store unreachable: a create's answer is sent and not kept (logged); a read is a 503.
- A background response kept `queued` is leased to this replica (`leases`, see
  zerohop.api.responses.leases); a read of one still running whose lease ended fails it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from zerohop.api.errors import ApiError
from zerohop.api.responses.leases import ResponseLeases, failed_body
from zerohop.gateway.store.repositories import ResponseRepository
from zerohop.gateway.store.response_tables import UNFINISHED, ResponseRow

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 30 * 86400.0
DEFAULT_MAX_BYTES = 16 * 2**20


@dataclass(slots=True, frozen=True)
class StoreOptions:
    ttl_s: float = DEFAULT_TTL_S
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ttl_s) and self.ttl_s > 0):
            raise ValueError(f"responses: ttl_s must be a positive number, got {self.ttl_s!r}")
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int):
            raise ValueError(f"responses: max_bytes must be an integer, got {self.max_bytes!r}")
        if self.max_bytes < 1024:
            raise ValueError(f"responses: max_bytes must be at least 1024, got {self.max_bytes}")


@dataclass(slots=True)
class Found:
    """A stored response: its status, its object and the items before its output."""

    status: str
    body: dict[str, Any]
    items: list[Any]


def not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(
        404,
        f"Response with id '{response_id}' not found.",
        param=param,
        code="previous_response_not_found" if param == "previous_response_id" else None,
    )


class StoredResponses:
    """The stored responses of one server, in its store's response repository (each call
    in a worker thread)."""

    def __init__(
        self,
        repository: ResponseRepository,
        options: StoreOptions = StoreOptions(),
        clock: Callable[[], float] = time.time,
        leases: ResponseLeases | None = None,
    ) -> None:
        self.repository, self.options, self.clock = repository, options, clock
        self.leases = leases or ResponseLeases(repository, f"local-{id(self):x}", clock=clock)

    async def get(
        self, tenant: str, response_id: str, param: str | None = None, check: bool = True
    ) -> Found:
        """The tenant's response `response_id`; the 404 when there is none. `check`: a
        running one whose lease ended is failed first."""
        try:
            row = await asyncio.to_thread(self.repository.get, tenant, response_id, self.clock())
        except Exception:
            log.exception("responses: reading %s failed", response_id)
            raise ApiError(503, "the server could not read its stored responses now") from None
        if row is None:
            raise not_found(response_id, param)
        body, status = _current(orjson.loads(row.body)), row.status
        ended = row.lease_until is not None and row.lease_until < self.clock()
        if check and ended and row.status in UNFINISHED:
            if not await self.leases.fail(tenant, response_id, body):  # it ended meanwhile
                return await self.get(tenant, response_id, param, check=False)
            body = failed_body(body)
            status = body["status"]
        return Found(status, body, orjson.loads(row.items))

    async def put(self, tenant: str, body: dict[str, Any], items: list[Any]) -> bool:
        """Keep a response (best-effort: False when it is too large or the store failed)."""
        now = self.clock()
        encoded, seen = orjson.dumps(body).decode(), orjson.dumps(items).decode()
        if len(encoded) + len(seen) > self.options.max_bytes:
            limit = self.options.max_bytes
            log.info("responses: %s is larger than %d bytes, not kept", body["id"], limit)
            return False
        running = body.get("background") and body["status"] in UNFINISHED
        lease = self.leases.lease() if running else None
        row = ResponseRow(
            body["id"], tenant, body["status"], encoded, seen, now + self.options.ttl_s, lease
        )
        try:
            await asyncio.to_thread(self.repository.put, row, now)
        except Exception:
            log.exception("responses: keeping %s failed", body["id"])
            return False
        return True

    async def finish(self, tenant: str, body: dict[str, Any]) -> bool:
        """A background response's end: its final object, unless it was cancelled meanwhile
        (only a queued or running response changes)."""
        args = (tenant, body["id"], body["status"], orjson.dumps(body).decode(), self.clock())
        try:
            return await asyncio.to_thread(self.repository.set_status, *args)
        except Exception:
            log.exception("responses: finishing %s failed", body["id"])
            return False
        finally:
            await self.leases.release(body["id"])

    async def cancel(self, tenant: str, response_id: str, body: dict[str, Any]) -> bool:
        args = (tenant, response_id, "cancelled", orjson.dumps(body).decode(), self.clock())
        return await asyncio.to_thread(self.repository.set_status, *args)

    async def delete(self, tenant: str, response_id: str) -> bool:
        now = self.clock()
        return await asyncio.to_thread(self.repository.delete, tenant, response_id, now)


def _current(body: dict[str, Any]) -> dict[str, Any]:
    """A response kept before its object had every field the API requires now."""
    for name, default in _ADDED_FIELDS.items():
        body.setdefault(name, default)
    return body


_ADDED_FIELDS: dict[str, Any] = {
    "completed_at": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
