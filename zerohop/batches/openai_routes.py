"""OpenAI's Files and Batches routes (`/v1/files...`, `/v1/batches...`), each scoped to the
caller's tenant: another tenant's file or batch is a 404, as one that does not exist.

Store calls and file contents run in a thread (`asyncio.to_thread`): the event loop never
waits on SQLite or the disk.
"""

from __future__ import annotations

import asyncio
from typing import Any

from zerohop.api.errors import ApiError
from zerohop.api.http.asgi import Handler, Receive, Scope, Send, read_json_body, send_json
from zerohop.api.serving.service import ServingContext
from zerohop.batches import openai_wire as wire
from zerohop.batches.multipart import read_upload
from zerohop.batches.openai_input import CreateBody, parse_create, parse_input_file
from zerohop.batches.records import BatchRecord, FileRecord, NewBatch
from zerohop.batches.routes import (
    limit_param,
    paged,
    query_params,
    retryable_outages,
    signed_snapshot,
    tenant_of,
)
from zerohop.batches.runner import BatchRunner
from zerohop.batches.store import AnyBatchStore
from zerohop.gateway.gateway import Call
from zerohop.gateway.keys.identity import Identity

CONTENT_CHUNK = 2**20  # bytes of a file's content sent at a time
UPLOAD_PURPOSES = ("batch",)  # what this server keeps files for


def openai(ctx: ServingContext, runner: BatchRunner) -> dict[tuple[str, str], Handler]:
    files, batches = Files(ctx, runner), Batches(ctx, runner)
    return retryable_outages({
        ("POST", "/v1/files"): files.create,
        ("GET", "/v1/files"): files.list,
        ("GET", "/v1/files/{id}"): files.retrieve,
        ("DELETE", "/v1/files/{id}"): files.delete,
        ("GET", "/v1/files/{id}/content"): files.content,
        ("POST", "/v1/batches"): batches.create,
        ("GET", "/v1/batches"): batches.list,
        ("GET", "/v1/batches/{id}"): batches.retrieve,
        ("POST", "/v1/batches/{id}/cancel"): batches.cancel,
    })  # fmt: skip


class Files:
    def __init__(self, ctx: ServingContext, runner: BatchRunner) -> None:
        self.ctx = ctx
        self.store: AnyBatchStore = runner.store

    async def create(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        upload = await read_upload(scope, receive, self.ctx.max_file_bytes, self.ctx.body_deadline)
        purpose = upload.fields.get("purpose")
        if purpose is None:
            raise ApiError(400, "purpose: a form field is required", param="purpose")
        if purpose not in UPLOAD_PURPOSES:
            message = f"purpose: this server keeps files for batches ('batch'), not {purpose!r}"
            raise ApiError(400, message, param="purpose")
        if "file" not in upload.files:
            raise ApiError(400, "file: a file part is required", param="file")
        filename, content = upload.files["file"]
        record = await asyncio.to_thread(
            self.store.put_file, tenant_of(call), purpose, filename, content
        )
        await send_json(send, 200, wire.file_object(record))

    async def list(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        query = query_params(scope)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order: 'asc' or 'desc', not {order!r}", param="order")
        limit = limit_param(query.get("limit"), 10_000, 10_000)
        page = await paged(
            self.store.list_files,
            tenant_of(call), limit=limit, after=query.get("after"), order=order,
            purpose=query.get("purpose"),
        )  # fmt: skip
        await send_json(send, 200, wire.list_page(page, [wire.file_object(f) for f in page.data]))

    async def retrieve(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        await send_json(send, 200, wire.file_object(await self._file(scope, call)))

    async def delete(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        file_id = (await self._file(scope, call)).id
        if not await asyncio.to_thread(self.store.delete_file, tenant_of(call), file_id):
            raise _no_file(file_id)
        await send_json(send, 200, {"id": file_id, "object": "file", "deleted": True})

    async def content(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        record = await self._file(scope, call)
        try:
            source = await asyncio.to_thread(open, record.path, "rb")
        except FileNotFoundError:
            raise _no_file(record.id) from None
        headers = [(b"content-type", b"application/octet-stream")]
        with source:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            while chunk := await asyncio.to_thread(source.read, CONTENT_CHUNK):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _file(self, scope: Scope, call: Call) -> FileRecord:
        file_id = scope["path_params"]["id"]
        record = await asyncio.to_thread(self.store.file, tenant_of(call), file_id)
        if record is None:
            raise _no_file(file_id)
        return record


class Batches:
    def __init__(self, ctx: ServingContext, runner: BatchRunner) -> None:
        self.ctx = ctx
        self.runner = runner
        self.store: AnyBatchStore = self.runner.store

    async def create(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        ctx = self.ctx
        body = parse_create(
            await read_json_body(scope, receive, ctx.max_body_bytes, ctx.body_deadline)
        )
        batch = await asyncio.to_thread(self._create, call.identity, body)
        self.runner.wake()
        await self._send_batch(send, batch)

    def _create(self, identity: Identity, body: CreateBody) -> BatchRecord:
        tenant = identity.tenant.name
        record = self.store.file(tenant, body.input_file_id)
        if record is None:
            raise _no_file(body.input_file_id, param="input_file_id")
        if record.purpose != "batch":
            message = f"input_file_id: file {record.id} has purpose {record.purpose!r}, not 'batch'"
            raise ApiError(400, message, param="input_file_id")
        parsed = parse_input_file(self.store.read_file(record), body.endpoint, self.ctx.names)
        new = NewBatch(
            tenant, identity.key_id, "openai", body.endpoint, model=parsed.model,
            completion_window=body.completion_window, input_file_id=record.id,
            metadata=body.metadata, errors=parsed.errors or None,
            identity=signed_snapshot(identity),
        )  # fmt: skip
        return self.store.create_batch(new, [] if parsed.errors else parsed.lines)

    async def list(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        query = query_params(scope)
        limit = limit_param(query.get("limit"), 20, 100)
        page = await paged(
            self.store.list_batches, tenant_of(call), "openai", limit=limit,
            after_id=query.get("after"),
        )  # fmt: skip
        rendered = [await self._rendered(batch) for batch in page.data]
        await send_json(send, 200, wire.list_page(page, rendered))

    async def retrieve(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        await self._send_batch(send, await self._batch(scope, call))

    async def cancel(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        batch_id = (await self._batch(scope, call)).id
        batch = await asyncio.to_thread(self.store.cancel_batch, tenant_of(call), batch_id)
        if batch is None:
            raise _no_batch(batch_id)
        self.runner.cancel(batch_id)
        await self._send_batch(send, batch)

    async def _batch(self, scope: Scope, call: Call) -> BatchRecord:
        batch_id = scope["path_params"]["id"]
        batch = await asyncio.to_thread(self.store.batch, tenant_of(call), batch_id)
        if batch is None or batch.api != "openai":
            raise _no_batch(batch_id)
        return batch

    async def _rendered(self, batch: BatchRecord) -> dict[str, Any]:
        return wire.batch_object(batch, await asyncio.to_thread(self.store.counts, batch.id))

    async def _send_batch(self, send: Send, batch: BatchRecord) -> None:
        await send_json(send, 200, await self._rendered(batch))


def _no_file(file_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"No such File object: {file_id}", param=param)


def _no_batch(batch_id: str) -> ApiError:
    return ApiError(404, f"No such Batch object: {batch_id}")
