"""Message threads on the Anthropic surface (the `message-threads-2026-08-12` beta): the
server keeps a conversation so that each later turn sends only its new messages.

The API's shape (anthropic SDK 2.16, `types/beta/beta_message_thread_param.py`):
`"thread": {"type": "create"}` sends the whole conversation, with `system` and `tools`, and
the server keeps it, with the answer, under the response's `id`; `"thread": {"type":
"continue", "previous_message_id": ID}` sends only the messages since that response, and the
server puts the kept ones (and its `system` and `tools`) before them. The response is the
usual message; its `id` is what the next turn continues from. There are no thread endpoints.

Decisions where the API leaves room:
- A thread belongs to the tenant of the key that created it (every key of a tenant may
  continue it). Another tenant's id, an unknown one and an expired one are the same 404
  `not_found_error` (`error_code: thread_not_found`): nothing tells them apart.
- Kept in the key store (`zerohop.gateway.store.thread_tables`: SQLite per replica, or the
  fleet's PostgreSQL, so any replica continues any thread). A thread stays for `ttl_s`
  (default 1 hour) after its last request; Anthropic's keeps it 5 minutes.
- Each response continues once, as in the API: continuing one that was continued is a 400
  `thread_already_continued`, one whose continue is still answering a 400
  `thread_continue_in_flight`. The answer is kept when it is complete (streamed or not)
  and before its last bytes are sent, so the client's next turn finds it; a failed or
  cancelled answer is not kept, and its response may be continued again.
- A continue may repeat `system` and `tools` if they are the thread's own (compared as JSON
  values); a different one is a 400 `thread_fingerprint_mismatch` naming it.
- Bounded: a thread (its JSON: system, tools and every message) holds at most `max_bytes`
  (default 8 MiB). An answer that takes it past that is still sent, but the thread ends
  there: continuing from it is the 404 `thread_not_found`, saying so, and the SDKs replay
  the whole conversation under a new thread (whose own answer is again not kept if it is as
  large: each turn is then sent whole).
- The messages are kept as the client sent them (their JSON, unparsed) and the answer as the
  response's content blocks; a continue decodes them with the request's schema, so what a
  request may hold a thread may too (context edits apply to the whole conversation).
- Not with `continue_token_ids` (a 400 `thread_unsupported_request`): the thread's turn is
  the interrupted request's, so zerohop.client does not resume a thread mid-stream: it
  fails over (starting the turn over) only before any text reached the caller, and after
  that ends the stream with the API's `overloaded_error` event (tests/test_client_threads.py).
  It holds a thread turn's `message_start` back until the first text, so a turn started
  over is the caller's under the id it is kept under (tests/test_client_ids.py).
  `return_token_ids` is accepted.
- The store unreachable: a continue is the 404 (the client replays), a create's answer is
  sent and not kept. Threads are best-effort, as in the API.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from zerohop.api.anthropic.schema import (
    Message,
    MessagesRequest,
    TextBlock,
    ThreadContinue,
    ToolDef,
)
from zerohop.api.errors import ApiError
from zerohop.gateway.store.repositories import ThreadRepository
from zerohop.gateway.store.thread_tables import NewThreadRow, Taken

log = logging.getLogger(__name__)

BETA = "message-threads-2026-08-12"
DEFAULT_MAX_BYTES = 8 * 2**20
MAX_MAX_BYTES = 2**30  # a TEXT value either store takes whole
DEFAULT_TTL_S = 3600.0


@dataclass(slots=True, frozen=True)
class ThreadOptions:
    """How much a thread may hold (bytes of its JSON) and how long it stays unused."""

    max_bytes: int = DEFAULT_MAX_BYTES
    ttl_s: float = DEFAULT_TTL_S

    def __post_init__(self) -> None:
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int):
            raise ValueError(f"threads: max_bytes must be an integer, got {self.max_bytes!r}")
        if not 1024 <= self.max_bytes <= MAX_MAX_BYTES:
            raise ValueError(
                f"threads: max_bytes must be between 1024 and {MAX_MAX_BYTES}, got {self.max_bytes}"
            )
        if not (math.isfinite(self.ttl_s) and self.ttl_s > 0):
            raise ValueError(f"threads: ttl_s must be a positive number, got {self.ttl_s!r}")


NULL = msgspec.Raw(b"null")  # msgspec takes no `Raw | None`: an absent value is this


class _Parts(msgspec.Struct):
    """The parts of a request body a thread keeps, as sent (other fields are ignored)."""

    messages: list[msgspec.Raw] = []
    system: msgspec.Raw = NULL
    tools: msgspec.Raw = NULL


class Kept(msgspec.Struct, forbid_unknown_fields=True):
    """A thread as stored: `system` and `tools` of its create, and every message so far."""

    system: msgspec.Raw = NULL
    tools: msgspec.Raw = NULL
    messages: list[msgspec.Raw] = []


_PARTS = msgspec.json.Decoder(_Parts)
_KEPT = msgspec.json.Decoder(Kept)
_MESSAGES = msgspec.json.Decoder(list[Message])
_SYSTEM = msgspec.json.Decoder(str | list[TextBlock] | None)
_TOOLS = msgspec.json.Decoder(list[ToolDef] | None)
_ENCODE = msgspec.json.Encoder()


def thread_error(status: int, code: str, message: str) -> ApiError:
    """An error of the API's threads, with the `error.details.error_code` the SDKs read."""
    return ApiError(status, message, details={"error_code": code})


@dataclass(slots=True)
class ThreadTurn:
    """One request on a thread: what it continues (None: it creates the thread), the thread
    kept before it, and this request's messages. `answered` keeps the answer; `abandon`
    gives the continued response back when there is none."""

    threads: Threads
    tenant: str
    continues: str | None
    kept: Kept
    new: list[msgspec.Raw]
    turns: int = 0
    done: bool = field(default=False)

    async def answered(self, message_id: str, content: list[dict[str, Any]]) -> None:
        """The answer is complete: keep the thread up to it (best-effort: a store error is
        logged, and the next continue from it is a 404)."""
        if self.done:
            return
        self.done = True
        answer = msgspec.Raw(orjson.dumps({"role": "assistant", "content": content}))
        kept = Kept(self.kept.system, self.kept.tools, [*self.kept.messages, *self.new, answer])
        body = _ENCODE.encode(kept)
        size = len(body)
        too_large = size > self.threads.options.max_bytes
        if too_large:
            log.info(
                "thread %s: %d bytes > %d, not kept",
                message_id,
                size,
                self.threads.options.max_bytes,
            )
        row = NewThreadRow(
            message_id=message_id,
            tenant=self.tenant,
            body=None if too_large else body.decode(),
            bytes=size,
            turns=self.turns + 1,
            continues=self.continues,
        )
        await self.threads.put(row)

    async def abandon(self) -> None:
        """The request ended without a complete answer: its continued response is open
        again (nothing was kept)."""
        if self.done:
            return
        self.done = True
        if self.continues is not None:
            await self.threads.release(self.tenant, self.continues)


class Threads:
    """The threads of one server, in its store's thread repository (each call in a worker
    thread)."""

    def __init__(
        self,
        repository: ThreadRepository,
        options: ThreadOptions = ThreadOptions(),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.repository, self.options, self.clock = repository, options, clock

    async def begin(
        self, request: MessagesRequest, body: bytes, tenant: str
    ) -> tuple[MessagesRequest, ThreadTurn | None]:
        """The request as the model sees it (a continue with the thread's messages, system
        and tools first) and its turn on the thread; (request, None) without `thread`."""
        thread = request.thread
        if thread is None:
            return request, None
        if request.continue_token_ids:
            raise thread_error(
                400, "thread_unsupported_request", "thread: not supported with continue_token_ids"
            )
        parts = _PARTS.decode(body)
        if not isinstance(thread, ThreadContinue):
            kept = Kept(parts.system, parts.tools, [])
            return request, ThreadTurn(self, tenant, None, kept, parts.messages)
        taken = await self.take(tenant, thread.previous_message_id)
        turn = ThreadTurn(self, tenant, thread.previous_message_id, Kept(), parts.messages)
        try:
            assert taken.body is not None
            turn.kept, turn.turns = _KEPT.decode(taken.body), taken.turns
            return _continued(request, parts, turn.kept), turn
        except BaseException:
            await turn.abandon()
            raise

    # -- the store, in a worker thread ----------------------------------------------------------

    async def take(self, tenant: str, message_id: str) -> Taken:
        """The thread ending at `message_id`, marked in flight; its refusal as an ApiError."""
        now = self.clock()
        try:
            taken = await asyncio.to_thread(
                self.repository.take, tenant, message_id, now, self.options.ttl_s
            )
        except Exception:
            log.exception("threads: reading thread %s failed", message_id)
            taken = Taken("not_found")
            return _refuse(taken, message_id, "the server could not read its threads now")
        return _refuse(taken, message_id)

    async def put(self, row: NewThreadRow) -> None:
        try:
            await asyncio.to_thread(self.repository.put, row, self.clock(), self.options.ttl_s)
        except Exception:
            log.exception("threads: keeping thread %s failed", row.message_id)

    async def release(self, tenant: str, message_id: str) -> None:
        try:
            await asyncio.to_thread(self.repository.release, tenant, message_id, self.clock())
        except Exception:
            log.exception("threads: releasing thread %s failed", message_id)


def _refuse(taken: Taken, message_id: str, why: str | None = None) -> Taken:
    """`taken` when it was taken; else the API's error for what was found."""
    if taken.outcome == "taken":
        return taken
    if taken.outcome == "continued":
        raise thread_error(
            400,
            "thread_already_continued",
            f"thread: the response {message_id} has already been continued, and each response"
            " can be continued only once: continue from the thread's most recent response id",
        )
    if taken.outcome == "in_flight":
        raise thread_error(
            400,
            "thread_continue_in_flight",
            f"thread: another request is still continuing from {message_id}: wait for it and"
            " continue from its response id, or replay the conversation with"
            ' thread {"type": "create"}',
        )
    reason = why or (
        "the thread grew past the size this server keeps"
        if taken.outcome == "too_large"
        else "no thread ends at it"
    )
    raise thread_error(
        404,
        "thread_not_found",
        f"thread: previous_message_id {message_id}: {reason}; replay the full conversation"
        ' with thread {"type": "create"}',
    )


def _continued(request: MessagesRequest, parts: _Parts, kept: Kept) -> MessagesRequest:
    """`request` after the thread's messages, with its system and tools (a repeated one must
    be the same)."""
    repeated = (("system", parts.system, kept.system), ("tools", parts.tools, kept.tools))
    for name, sent, own in repeated:
        if not _is_null(sent) and _canonical(sent) != _canonical(own):
            raise thread_error(
                400,
                "thread_fingerprint_mismatch",
                f"{name}: differs from the thread's, which keeps the one it was created with:"
                ' leave it out, or replay the conversation with thread {"type": "create"}',
            )
    messages = _MESSAGES.decode(b"[" + b",".join(bytes(m) for m in kept.messages) + b"]")
    system, tools = _SYSTEM.decode(kept.system), _TOOLS.decode(kept.tools)
    return msgspec.structs.replace(
        request, messages=[*messages, *request.messages], system=system, tools=tools
    )


def _is_null(raw: msgspec.Raw) -> bool:
    """Whether a raw JSON value is absent or `null` (the field's default)."""
    return bytes(raw).strip() == b"null"


def _canonical(raw: msgspec.Raw) -> bytes:
    """A JSON value's bytes with its keys sorted: equal values, equal bytes."""
    return orjson.dumps(orjson.loads(bytes(raw)), option=orjson.OPT_SORT_KEYS)
