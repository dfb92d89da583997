"""An identical request resent by the same caller while the first still runs is attached to
it, not computed twice (agent harnesses retry a slow request with the same body).

Decisions:
- The key is (the caller's key id, a hash of the key it presented, the surface, a hash of
  the method, path, query string, the raw body bytes and the headers that change a
  response: `anthropic-beta`, `zerohop-send-times`). Two keys are never attached to each
  other, not even two keys of one tenant, nor two presented keys on a server without keys.
  Headers that differ between an SDK's tries (`x-stainless-retry-count`, user agents) are
  left out.
- Attached only when the answer could not differ anyway or the caller says it is the same
  request: sampling that is deterministic (temperature 0, or an OpenAI `seed`), or a
  request the official SDKs mark as a retry (`x-stainless-retry-count` 1 or more; Claude
  Code and the Agents SDKs send it). Two identical sampled requests that are not retries
  (best-of-n by parallel requests) each get their own answer.
- The attached caller gets the first one's response byte for byte, streaming or not: what
  was sent so far is replayed, then it follows live. The response is the first caller's
  (its ids and `request-id`); the load and rate headers are the attached caller's own. The
  attached request costs its key nothing: no second admission, no tokens (the audit log
  records it with none).
- The request runs while anyone listens: the first caller's disconnect does not cancel it
  while an attached caller still listens; the last one's does (`receive` below tells the
  engine's disconnect watcher only then).
- A request refused before it sent anything is refused again to each attached caller with
  the same error, under the caller's own request id.
- Only requests still running are attached: once the last listener has gone the request is
  aborted (its KV blocks freed, the prefilled ones kept in the prefix cache), and a retry
  that comes later is computed again, from the cache.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from zerohop.api.errors import ApiError
from zerohop.api.http.asgi import Receive, Scope, Send, api_key, header, on_disconnect
from zerohop.gateway.gateway import Call, GatewayError

Work = Callable[[Receive, Send], Awaitable[None]]

RETRY_HEADER = b"x-stainless-retry-count"
_KEYED_HEADERS = (b"anthropic-beta", b"zerohop-send-times")


@dataclass(slots=True)
class SharedRun:
    """One request's response as sent so far, and who listens to it."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    listeners: int = 1
    followers: int = 0
    done: bool = False
    error: BaseException | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # every listener left

    def record(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        self.notify()

    def notify(self) -> None:
        if self.followers:
            self.changed.set()
            self.changed = asyncio.Event()

    def end(self, error: BaseException | None) -> None:
        self.done, self.error = True, error
        self.notify()

    def leave(self) -> None:
        self.listeners -= 1
        if self.listeners <= 0:
            self.gone.set()

    async def receive(self) -> dict[str, Any]:
        """The request's `receive` for the engine's disconnect watcher: a disconnect once
        the last listener has gone."""
        await self.gone.wait()
        return {"type": "http.disconnect"}


def run_key(call: Call, scope: Scope, body: bytes) -> bytes:
    digest = hashlib.sha256()
    for part in (
        call.identity.key_id.encode(),
        (api_key(scope) or "").encode(),
        call.surface.encode(),
        scope.get("method", "").encode(),
        scope.get("path", "").encode(),
        scope.get("query_string", b""),
        *(header(scope, name) or b"" for name in _KEYED_HEADERS),
    ):
        digest.update(hashlib.sha256(part).digest())
    digest.update(body)
    return digest.digest()


def may_attach(scope: Scope, temperature: float | None, seed: int | None = None) -> bool:
    """Whether a request may attach to an identical running one: its answer could not
    differ (temperature 0, a seed) or an SDK says it is a retry (see the module doc)."""
    return temperature == 0 or seed is not None or is_retry(scope)


def is_retry(scope: Scope) -> bool:
    """Whether an official SDK marked the request a retry of an earlier one."""
    value = header(scope, RETRY_HEADER)
    return value is not None and value.strip().isdigit() and int(value) > 0


class SharedRuns:
    """The running requests that an identical one may attach to, by `run_key`."""

    def __init__(self) -> None:
        self.runs: dict[bytes, SharedRun] = {}

    async def serve(
        self, key: bytes, attach: bool, receive: Receive, send: Send, work: Work
    ) -> None:
        """Attach to the running request under `key` when `attach` allows; else run `work`
        (with the shared `receive`, and a `send` that records) for others to attach to."""
        run = self.runs.get(key)
        if attach and run is not None and not run.done and not run.gone.is_set():
            return await _follow(run, receive, send)  # not one being aborted: all left it
        run = SharedRun()
        self.runs[key] = run
        watcher = on_disconnect(receive, run.leave)

        async def recording_send(message: dict[str, Any]) -> None:
            run.record(message)
            await send(message)

        error: BaseException | None = None
        try:
            await work(run.receive, recording_send)
        except BaseException as exc:
            error = exc
            raise
        finally:
            watcher.cancel()
            if self.runs.get(key) is run:
                del self.runs[key]
            run.end(error)


async def _follow(run: SharedRun, receive: Receive, send: Send) -> None:
    """Replay what `run` sent, then follow it live, until it ends or this caller goes."""
    run.listeners += 1
    run.followers += 1
    left = False

    def leave() -> None:
        nonlocal left
        if not left:
            left = True
            run.leave()
            run.notify()

    watcher = on_disconnect(receive, leave)
    sent = 0
    try:
        while not left:
            while sent < len(run.messages):
                await send(run.messages[sent])
                sent += 1
            if run.done:
                break
            await run.changed.wait()
        if left:
            return
        if sent == 0 and run.error is not None:
            raise run.error if isinstance(run.error, ApiError | GatewayError) else _failed()
        if sent and run.messages[-1].get("more_body", False):  # it ended mid-response
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        watcher.cancel()
        run.followers -= 1
        leave()


def _failed() -> ApiError:
    return ApiError(500, "internal server error")
