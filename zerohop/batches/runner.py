"""The batch runner: starts waiting lines on the capacity interactive work leaves.

Every wake-up (a line finished, a batch created or cancelled, a 1 s tick) it renews the
leases of the lines it runs and settles lines whose lease ended (the fleet store's:
zerohop.batches.pg_store), expires due batches, ends batches with nothing open, and starts
lines while fewer than `room()` run, no request of a class above BACKGROUND waits in the
engine, and at most `LOOKAHEAD` of its own lines wait there unstarted. Lines are taken in
turn from each tenant (`next_waiting`); the engine's fair share orders them from there. A
retryable refusal (a rate limit, the engine restarting) puts the line back and backs its
tenant off until `retry-after`.

`stop` aborts running lines and puts them back to waiting; after a kill -9 the store's
recovery at open does the same, so a line running at the crash runs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from zerohop.api.errors import ApiError
from zerohop.batches.line_call import Answer, RunLine, call_line, line_call
from zerohop.batches.records import CANCELED, ERRORED, SUCCEEDED, RequestCounts, WaitingLine
from zerohop.batches.results import api_of, end_batch, refused
from zerohop.batches.store import AnyBatchStore
from zerohop.engine.base.outputs import EngineStatsDict
from zerohop.engine.client import Queued
from zerohop.engine.sched.fair_share import BACKGROUND
from zerohop.engine.sched.step_times import StepCurve
from zerohop.gateway.gateway import Call
from zerohop.gateway.keys.identity import Identity
from zerohop.gateway.store.spec import StoreUnavailable

log = logging.getLogger(__name__)

TICK = 1.0  # seconds between housekeeping passes (expiry, ending batches, counts)
RAMP = 0.05  # seconds between starts while lines wait and there is room
LOOKAHEAD = 2  # own lines waiting in the engine unstarted, at most
MAX_ENGINE_ATTEMPTS = 3  # a line the engine lost this often is errored, not run again


class EngineView(Protocol):
    """What the runner reads of the engine (the EngineClient): its step times and queue."""

    @property
    def latest_stats(self) -> EngineStatsDict | None: ...

    @property
    def queued(self) -> Mapping[str, Queued]: ...


# A line's caller as it may call the model now, from its key id and (for a signed key) the
# snapshot its batch keeps; None once it may not.
IdentityFor = Callable[[str, dict[str, Any] | None], Identity | None]


class BatchRunner:
    def __init__(
        self,
        store: AnyBatchStore,
        engine: EngineView,
        identity_for: IdentityFor,
        cap: int,
        step_target: float = 0.0,
    ) -> None:
        self.store, self.engine, self.identity_for = store, engine, identity_for
        self.cap = max(1, cap)
        self.step_target = step_target  # seconds a decode step of the lines should stay within
        self.run_line: RunLine | None = None  # the app's, set before `start`
        self.counts: dict[str, RequestCounts] = {}  # per tenant, for /metrics
        self._running: dict[tuple[str, int], tuple[asyncio.Task[None], asyncio.Event]] = {}
        self._calls: dict[tuple[str, int], Call] = {}  # running lines' calls, once made
        self._canceled: set[tuple[str, int]] = set()
        self._backoff: dict[str, float] = {}  # tenant -> monotonic time it may run again
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._dirty = True

    def start(self) -> None:
        assert self.run_line is not None, "set run_line (the app's) first"
        self._task = asyncio.create_task(self._loop())

    def wake(self) -> None:
        self._dirty = True
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        """Abort the batch's running lines (the store canceled its waiting ones)."""
        for key, (_, stop) in self._running.items():
            if key[0] == batch_id:
                self._canceled.add(key)
                stop.set()
        self.wake()

    async def stop(self) -> None:
        """Start nothing more, abort what runs and put it back to waiting."""
        self._stopping = True
        if self._task is not None:  # a line it marked running meanwhile: recovered at open
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for _, stop in self._running.values():
            stop.set()
        tasks = [task for task, _ in self._running.values()]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        last_housekeeping = 0.0
        while not self._stopping:
            started = 0
            try:
                if self._dirty or time.monotonic() - last_housekeeping >= TICK:
                    last_housekeeping = time.monotonic()
                    await self._housekeeping()
                started = await self._fill()
            except StoreUnavailable as exc:  # the fleet store is down: at the next tick
                log.warning("batches: the runner's pass failed: %s", exc)
            except Exception:  # a locked or full disk: try again at the next tick
                log.exception("batches: the runner's pass failed")
            with contextlib.suppress(TimeoutError):
                # Soon again while lines wait to begin: the next may start when they do.
                async with asyncio.timeout(RAMP if started or self._unstarted() else TICK):
                    await self._wake.wait()
            self._wake.clear()

    async def _housekeeping(self) -> None:
        store = self.store
        changed, self._dirty = self._dirty, False
        if self._running:
            await asyncio.to_thread(store.renew_leases)
        changed |= bool(await asyncio.to_thread(store.expire_leases))
        changed |= bool(await asyncio.to_thread(store.expire_due))
        for batch in await asyncio.to_thread(store.open_batches):
            changed |= await asyncio.to_thread(end_batch, store, batch)
        if changed:
            self.counts = await asyncio.to_thread(store.tenant_line_counts)

    async def _fill(self) -> int:
        free = min(self.room() - len(self._running), LOOKAHEAD - self._unstarted())
        if free <= 0 or self._stopping or not self._engine_has_room():
            return 0
        now = time.monotonic()
        backing_off = [t for t, until in self._backoff.items() if until > now]
        started = 0
        for line in await asyncio.to_thread(self.store.next_waiting, free, exclude=backing_off):
            key = (line.line.batch_id, line.line.index)
            if key in self._running:
                continue
            if await asyncio.to_thread(self.store.mark_running, *key):
                stop = asyncio.Event()
                task = asyncio.create_task(self._serve(line, stop))
                self._running[key] = (task, stop)
                self._dirty = True
                started += 1
        return started

    def room(self) -> int:
        """Lines at once: the cap, and no more than the engine decodes within the inter-token
        target by its measured step times. Where a step's cost grows with its rows (a CPU),
        more lines would add little throughput and make every step longer, which an
        interactive request arriving during one waits for."""
        stats = self.engine.latest_stats
        curve = StepCurve.from_rows([] if stats is None else stats["step_times"].get("decode", []))
        if curve is None or self.step_target <= 0:
            return self.cap
        return max(1, curve.largest_within(self.step_target, self.cap))

    def _unstarted(self) -> int:
        """Own lines the engine has not begun (not admitted yet, or queued there)."""
        calls = [self._calls.get(key) for key in self._running]
        return sum(1 for call in calls if call is None or call.first_delta_at is None)

    def _engine_has_room(self) -> bool:
        queued = self.engine.queued
        # Interactive or batch-class work waits: leave it the room.
        return not any(request.priority < BACKGROUND for request in list(queued.values()))

    async def _serve(self, waiting: WaitingLine, stop: asyncio.Event) -> None:
        line = waiting.line
        key = (line.batch_id, line.index)
        try:
            await self._answer(waiting, stop)
        except Exception:
            log.exception("batches: line %s of %s failed", line.custom_id, line.batch_id)
            error = ApiError(500, "internal server error while running this batch line")
            result = refused(error, api_of(waiting.endpoint))
            await asyncio.to_thread(self.store.record_result, *key, ERRORED, result)
        finally:
            self._running.pop(key, None)
            self._calls.pop(key, None)
            self._canceled.discard(key)
            self.wake()

    async def _answer(self, waiting: WaitingLine, stop: asyncio.Event) -> None:
        line, store, api = waiting.line, self.store, api_of(waiting.endpoint)
        key = (line.batch_id, line.index)
        identity = self.identity_for(waiting.key_id, waiting.identity)
        if identity is None:
            error = ApiError(401, f"API key {waiting.key_id} is revoked, expired or invalid")
            await asyncio.to_thread(store.record_result, *key, ERRORED, refused(error, api))
            return
        assert self.run_line is not None
        call = self._calls[key] = line_call(identity, (line.batch_id, line.custom_id), api)
        answer = await call_line(self.run_line, call, waiting.endpoint, line.params, stop)
        if self._stopping:
            await asyncio.to_thread(store.requeue, *key)
        elif key in self._canceled:
            await asyncio.to_thread(store.record_result, *key, CANCELED, None)
        elif self._retryable(answer, line.attempts, waiting.tenant):
            await asyncio.to_thread(store.requeue, *key)
        else:
            state = SUCCEEDED if answer.status == 200 else ERRORED
            await asyncio.to_thread(store.record_result, *key, state, answer.stored())

    def _retryable(self, answer: Answer, attempts: int, tenant: str) -> bool:
        """A refusal that waiting cures: back the tenant off for its retry-after."""
        if answer.status not in (429, 503, 529) or answer.header(b"x-should-retry") == "false":
            return False
        retry_after = answer.header(b"retry-after-ms")
        seconds = float(retry_after) / 1000 if retry_after else 1.0
        if answer.status != 429 and attempts >= MAX_ENGINE_ATTEMPTS:
            return False  # the engine keeps losing this line: error it, go on
        self._backoff[tenant] = time.monotonic() + min(seconds, 60.0)
        return True
