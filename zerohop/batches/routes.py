"""The Message Batches routes (`/v1/messages/batches`...): create, list, retrieve, cancel,
delete and results, each scoped to the caller's tenant (another tenant's batch is a 404).

Store calls run in a thread (`asyncio.to_thread`): the event loop never waits on SQLite.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

import orjson

from zerohop.api.errors import ApiError
from zerohop.api.http.asgi import (
    Handler,
    Receive,
    Scope,
    Send,
    header,
    read_json_body,
    send_json,
)
from zerohop.api.serving.service import ServingContext
from zerohop.batches import wire
from zerohop.batches.anthropic_input import parse_create
from zerohop.batches.records import BatchNotEnded, BatchRecord, NewBatch, UnknownCursor
from zerohop.batches.runner import BatchRunner
from zerohop.batches.store import AnyBatchStore
from zerohop.gateway.gateway import Call
from zerohop.gateway.keys.identity import Identity
from zerohop.gateway.keys.identity_snapshot import snapshot
from zerohop.gateway.store.spec import StoreUnavailable

log = logging.getLogger(__name__)

BASE = "/v1/messages/batches"


def anthropic(ctx: ServingContext, runner: BatchRunner) -> dict[tuple[str, str], Handler]:
    routes = MessageBatches(ctx, runner)
    return retryable_outages({
        ("POST", BASE): routes.create,
        ("GET", BASE): routes.list,
        ("GET", BASE + "/{id}"): routes.retrieve,
        ("POST", BASE + "/{id}/cancel"): routes.cancel,
        ("DELETE", BASE + "/{id}"): routes.delete,
        ("GET", BASE + "/{id}/results"): routes.results,
    })  # fmt: skip


def retryable_outages(table: dict[tuple[str, str], Handler]) -> dict[tuple[str, str], Handler]:
    """Each route, answering a 503 (retryable, in the API's shape) while the fleet store
    that holds the batches cannot be reached."""
    return {route: _outage_is_503(handler) for route, handler in table.items()}


def _outage_is_503(handler: Handler) -> Handler:
    @functools.wraps(handler)
    async def guarded(scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        try:
            await handler(scope, receive, send, call)
        except StoreUnavailable:
            log.warning("batches: the fleet store is unreachable", exc_info=True)
            raise ApiError(503, "the batch store cannot be reached now; retry later") from None

    return guarded


class MessageBatches:
    def __init__(self, ctx: ServingContext, runner: BatchRunner) -> None:
        self.ctx = ctx
        self.runner = runner
        self.store: AnyBatchStore = self.runner.store

    async def create(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        body = await read_json_body(
            scope, receive, self.ctx.max_batch_bytes, self.ctx.body_deadline
        )
        lines = parse_create(body, self.ctx.names)
        identity = call.identity
        new = NewBatch(
            identity.tenant.name, identity.key_id, "anthropic", "/v1/messages",
            identity=signed_snapshot(identity),
        )  # fmt: skip
        batch = await asyncio.to_thread(self.store.create_batch, new, lines)
        self.runner.wake()
        await self._send_batch(scope, send, batch)

    async def list(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        query = query_params(scope)
        limit = limit_param(query.get("limit"))
        after_id, before_id = query.get("after_id"), query.get("before_id")
        if after_id and before_id:
            raise ApiError(400, "after_id and before_id: give one of them, not both")
        page = await paged(
            self.store.list_batches,
            tenant_of(call), "anthropic", limit=limit, after_id=after_id, before_id=before_id,
        )  # fmt: skip
        rendered = [await self._rendered(scope, batch) for batch in page.data]
        await send_json(send, 200, wire.page(page, rendered))

    async def retrieve(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        await self._send_batch(scope, send, await self._batch(scope, call))

    async def cancel(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        batch_id = (await self._batch(scope, call)).id
        batch = await asyncio.to_thread(self.store.cancel_batch, tenant_of(call), batch_id)
        if batch is None:
            raise _not_found(batch_id)
        self.runner.cancel(batch_id)
        await self._send_batch(scope, send, batch)

    async def delete(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        batch_id = (await self._batch(scope, call)).id
        try:
            deleted = await asyncio.to_thread(self.store.delete_batch, tenant_of(call), batch_id)
        except BatchNotEnded as exc:
            raise ApiError(400, str(exc)) from None
        if not deleted:
            raise _not_found(batch_id)
        self.runner.wake()
        await send_json(send, 200, {"id": batch_id, "type": "message_batch_deleted"})

    async def results(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        batch = await self._batch(scope, call)
        if batch.status != "ended":
            raise ApiError(400, f"batch {batch.id} has not ended yet: its results are not ready")
        headers = [(b"content-type", b"application/x-jsonl")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        pages = self.store.line_pages(batch.id)
        while lines := await asyncio.to_thread(next, pages, None):
            chunk = b"".join(orjson.dumps(wire.result_line(line)) + b"\n" for line in lines)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _batch(self, scope: Scope, call: Call) -> BatchRecord:
        batch_id = scope["path_params"]["id"]
        batch = await asyncio.to_thread(self.store.batch, tenant_of(call), batch_id)
        if batch is None or batch.api != "anthropic":
            raise _not_found(batch_id)
        return batch

    async def _rendered(self, scope: Scope, batch: BatchRecord) -> dict[str, Any]:
        counts = await asyncio.to_thread(self.store.counts, batch.id)
        return wire.message_batch(batch, counts, _results_url(scope, batch.id))

    async def _send_batch(self, scope: Scope, send: Send, batch: BatchRecord) -> None:
        await send_json(send, 200, await self._rendered(scope, batch))


def signed_snapshot(identity: Identity) -> dict[str, Any] | None:
    """What a batch keeps of a signed (JWT) key to run its lines as that caller later; a
    stored key is looked up again instead (zerohop.gateway.keys.identity_snapshot)."""
    return snapshot(identity) if identity.source == "jwt" else None


def tenant_of(call: Call) -> str:
    return call.identity.tenant.name


def _not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"no message batch with id {batch_id!r}")


def query_params(scope: Scope) -> dict[str, str]:
    parsed = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return {name: values[-1] for name, values in parsed.items()}


def limit_param(value: str | None, default: int = 20, most: int = 1000) -> int:
    if value is None:
        return default
    if not value.isdigit() or not 1 <= int(value) <= most:
        raise ApiError(400, f"limit: an integer from 1 to {most}, not {value!r}", param="limit")
    return int(value)


async def paged(list_call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A store list call in a thread; a cursor naming no object of the tenant is a 400."""
    try:
        return await asyncio.to_thread(list_call, *args, **kwargs)
    except UnknownCursor as exc:
        raise ApiError(400, str(exc), param="after") from None


def _results_url(scope: Scope, batch_id: str) -> str:
    path = f"{BASE}/{batch_id}/results"
    host = header(scope, b"host")
    if host is None:
        return path
    return f"{scope.get('scheme', 'http')}://{host.decode('latin-1')}{path}"
