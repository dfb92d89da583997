"""Background responses leased to the replica running them, so that a fleet sharing one
store (or one server restarting on its SQLite file) never leaves a response `in_progress`
until its TTL, and a `cancel` on any replica stops the generation where it runs.

- The put that keeps a background response `queued` leases it to this replica (`owner`, the
  fleet lease keeper's replica id or one of this process's own) for `ttl` seconds (the
  server's `--lease-ttl`, 60 s by default).
- Every `ttl / 4` seconds this replica's tick renews its leases. The renewal also names its
  responses that stopped running elsewhere: cancelled (the cancel writes `cancelled` on
  whichever replica gets it), failed by another replica, deleted or expired. The tick aborts
  their engine requests here; the generation's own end then finds the row finished and
  leaves it as it is.
- The same tick (on every replica) fails the responses whose lease ended unrenewed: their
  replica stopped. Each becomes `failed` with the error `server_error` "the replica running
  this response stopped" (its output as last kept: none, since a background response is
  kept when it is queued and when it ends). A `GET` of one does the same at once.
  Resuming it elsewhere is not attempted: its sampling state (and any output a client may
  have read) is lost with the replica, and a fresh run would answer something else under the
  same id.
- On a SQLite store (one server per file), the start fails every response the last process
  left leased: no other process can be running it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson

from zerohop.gateway.store.repositories import ResponseRepository
from zerohop.gateway.store.response_tables import Lease

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 60.0
STOPPED = "the replica running this response stopped"
Abort = Callable[[], None]


def failed_body(body: dict[str, Any]) -> dict[str, Any]:
    """A response whose replica stopped, as it is kept and returned from then on."""
    error = {"code": "server_error", "message": STOPPED}
    return {**body, "status": "failed", "error": error, "completed_at": None}


class ResponseLeases:
    """This replica's leases on the background responses it runs, and the tick that renews
    them, stops the cancelled ones and fails other replicas' expired ones."""

    def __init__(
        self,
        repository: ResponseRepository,
        owner: str,
        ttl: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.repository, self.owner, self.ttl, self.clock = repository, owner, ttl, clock
        self.running: dict[str, Abort] = {}  # response id -> how to abort its generation
        self._task: asyncio.Task[None] | None = None

    def lease(self) -> Lease:
        return Lease(self.owner, self.clock() + self.ttl)

    def track(self, response_id: str, abort: Abort) -> None:
        self.running[response_id] = abort

    async def release(self, response_id: str) -> None:
        """The response ended here: its lease goes (best-effort: else it expires)."""
        self.running.pop(response_id, None)
        try:
            await asyncio.to_thread(self.repository.release_lease, response_id)
        except Exception:
            log.warning("responses: releasing the lease of %s failed", response_id)

    def abort(self, response_id: str) -> bool:
        """Abort the response's generation when it runs here: True when it did."""
        abort = self.running.pop(response_id, None)
        if abort is not None:
            abort()
        return abort is not None

    async def fail(self, tenant: str, response_id: str, body: dict[str, Any]) -> bool:
        """Fail a response whose lease ended: False when it had ended meanwhile."""
        failed = orjson.dumps(failed_body(body)).decode()
        args = (tenant, response_id, "failed", failed, self.clock())
        changed = bool(await asyncio.to_thread(self.repository.set_status, *args))
        if changed:
            log.warning("responses: %s failed: its replica's lease ended", response_id)
        return changed

    async def tick(self, now: float | None = None) -> None:
        """Renew this replica's leases, abort its stopped responses, fail expired ones."""
        now = self.clock() if now is None else now
        renew = self.repository.renew_leases
        for response_id in await asyncio.to_thread(renew, self.owner, now + self.ttl, now):
            if self.abort(response_id):
                log.info("responses: %s stopped elsewhere: aborted here", response_id)
        await self.fail_expired(now)

    async def fail_expired(self, now: float) -> None:
        for expired in await asyncio.to_thread(self.repository.expired, now):
            await self.fail(expired.tenant, expired.response_id, orjson.loads(expired.body))

    async def start(self, recover: bool = False) -> None:
        """Tick every `ttl / 4` seconds; `recover` (a SQLite store, before serving): first
        fail every response the last process left leased."""
        if recover:
            try:
                await self.fail_expired(float("inf"))
            except Exception:
                log.exception("responses: failing the last run's background responses failed")
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 4)
            try:
                await self.tick()
            except Exception:  # the store unreachable: the next tick tries again
                log.warning("responses: renewing the background responses' leases failed")
