"""The replicas a client may use, kept current in the background.

A daemon thread runs an event loop of its own: it asks the discovery source for the replica
set every `refresh_interval` seconds and keeps one health task per replica (gRPC Watch or
`GET /ready`). Replicas that appear join the pool at once; replicas that disappear stop
getting new requests, while the requests already there finish. Choosing a replica reads this
state under a lock and never waits for the network. The sync httpx transport also runs its
requests on this loop.

Making a pool starts nothing: the thread starts at `start()`, on entering `with` or
`async with`, or on first use (a request, `choose`, `run`), and stops at `close()` or on
leaving the `with` block. The first use waits, at most `FIRST_ROUND_WAIT` seconds after the
start, for the first discovery round, so that a request made at once has replicas to go to.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import asdict
from typing import Any, TypeVar

import httpx2

from zerohop.client.affinity import AffinityPolicy, RoundRobinPolicy
from zerohop.client.discovery import DiscoveryError, Source, StaticSource, source_from_spec
from zerohop.client.health import poll_http, watch_grpc
from zerohop.client.pinning import Pins
from zerohop.client.replica import Replica

log = logging.getLogger(__name__)
T = TypeVar("T")

Replicas = str | Sequence[str] | Source  # a spec ("dns://...", "file:..."), URLs, or a Source

FIRST_ROUND_WAIT = 5.0  # seconds after the start that first use waits for discovery
CLOSE_WAIT = 5.0  # seconds close() waits for the background thread to end


def as_source(replicas: Replicas) -> Source:
    if isinstance(replicas, str):
        return source_from_spec(replicas)
    if isinstance(replicas, Sequence):
        return StaticSource(list(replicas))
    return replicas


class ReplicaPool:
    """Replicas found by `replicas` and health-checked in the background; see the module's
    docstring for when that background work starts and stops."""

    def __init__(
        self,
        replicas: Replicas,
        *,
        affinity: AffinityPolicy | RoundRobinPolicy | None = None,
        refresh_interval: float = 2.0,
        health_interval: float = 1.0,
        verify: bool | str = True,
        pins: Pins | None = None,
    ) -> None:
        """`verify`: TLS certificate checks for `https://` replicas (False, or a CA bundle's
        path), for requests and health checks alike. `pins`: which replica holds each thread
        and stored response this client relayed (`zerohop.client.pinning`)."""
        self.source = as_source(replicas)
        self.verify = verify
        self.affinity = affinity or AffinityPolicy()
        self.pins = pins if pins is not None else Pins()
        self.refresh_interval = refresh_interval
        self.health_interval = health_interval
        self.replicas: dict[str, Replica] = {}
        self.lock = threading.Lock()
        self.rng = random.Random()
        self._health: dict[str, asyncio.Task[None]] = {}
        self._state_lock = threading.Lock()  # guards starting and closing
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._stop = asyncio.Event()  # set on the pool's loop: the thread's work ends
        self._first_round: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._ended: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._first_round_by = 0.0  # monotonic time until which first use waits for it

    # -- starting and closing ----------------------------------------------------------

    def start(self) -> None:
        """Start discovery and health checks in the background (once: later calls only
        wait), and wait until the first discovery round is done, at most `FIRST_ROUND_WAIT`
        seconds after the start. RuntimeError once the pool is closed."""
        self._start_thread()
        if threading.current_thread() is not self._thread:
            concurrent.futures.wait([self._first_round], timeout=self._first_round_left())

    async def astart(self) -> None:
        """`start()` for a caller in an event loop: the wait does not block that loop."""
        self._start_thread()
        if not self._first_round.done():
            first_round = asyncio.shield(asyncio.wrap_future(self._first_round))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(first_round, timeout=self._first_round_left())

    @property
    def running(self) -> bool:
        """Whether the background thread was started and the pool is not closed."""
        return self._thread is not None and not self._closed

    def close(self) -> None:
        """Stop the background thread (and the sync transport's requests, which run on its
        loop), waiting up to `CLOSE_WAIT` seconds for it. Closing twice, or a pool that
        never started, is fine; using the pool after raises RuntimeError."""
        self._close_soon()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=CLOSE_WAIT)

    async def aclose(self) -> None:
        """`close()` for a caller in an event loop: the wait does not block that loop."""
        self._close_soon()
        if self._thread is not None and self._thread is not threading.current_thread():
            with contextlib.suppress(TimeoutError):
                ended = asyncio.shield(asyncio.wrap_future(self._ended))
                await asyncio.wait_for(ended, timeout=CLOSE_WAIT)
            if self._ended.done():
                self._thread.join()  # it has only to return from _run

    def __enter__(self) -> ReplicaPool:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> ReplicaPool:
        await self.astart()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _start_thread(self) -> None:
        if self._thread is not None and not self._closed:
            return  # started: the usual case, without the lock
        with self._state_lock:
            if self._closed:
                raise RuntimeError("this ReplicaPool is closed")
            if self._thread is not None:
                return
            self._loop = asyncio.new_event_loop()
            self._first_round_by = time.monotonic() + FIRST_ROUND_WAIT
            self._thread = threading.Thread(target=self._run, name="zerohop-client", daemon=True)
            self._thread.start()

    def _first_round_left(self) -> float:
        return max(0.0, self._first_round_by - time.monotonic())

    def _close_soon(self) -> None:
        with self._state_lock:
            self._closed = True
            loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # its loop has ended already
                loop.call_soon_threadsafe(self._stop.set)

    # -- choosing ----------------------------------------------------------------------

    def choose(
        self, prompt: str, exclude: set[str], pinned: str | None = None
    ) -> tuple[Replica, bool]:
        """A replica for `prompt` among those not in `exclude` (LookupError: none left),
        counted as in flight until `release`: the one holding the stored id `pinned` while
        it is usable, else the affinity policy's. Starts the pool if it was not."""
        if self._thread is None or self._closed:
            self.start()
        with self.lock:
            candidates = [r for url, r in self.replicas.items() if url not in exclude]
            replica, by_affinity = self.pins.replica(pinned, candidates), True
            if replica is None:
                replica, by_affinity = self.affinity.choose(prompt, candidates, self.rng)
            replica.in_flight += 1
            replica.stats.requests += 1
            replica.stats.by_affinity += by_affinity and not exclude  # first tries only
            return replica, by_affinity

    def release(self, replica: Replica) -> None:
        with self.lock:
            replica.in_flight -= 1

    def failed(self, replica: Replica, trip_breaker: bool, resumed: bool = False) -> None:
        """A request failed at `replica` and moves on (`resumed`: mid-answer); counted, the
        breaker told when the failure is the replica's, and no longer in flight there."""
        with self.lock:
            replica.stats.failures += 1
            replica.stats.failovers += 1
            replica.stats.resumes += resumed
        if trip_breaker:
            replica.breaker.failed()
        self.release(replica)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per replica: requests, failures, failovers, by_affinity, affinity_ratio, and its
        latest load and health."""
        with self.lock:
            return {url: _stats(r) for url, r in self.replicas.items()}

    def log_stats(self, level: int = logging.INFO) -> None:
        for url, stats in self.stats().items():
            log.log(level, "replica %s %s", url, stats)

    # -- the background loop -----------------------------------------------------------

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the pool's loop from another thread (starting the pool first
        if it was not), and wait for it."""
        try:
            self.start()
        except RuntimeError:
            coroutine.close()  # never awaited: no warning about it
            raise
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _run(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
            _cancel_the_rest(self._loop)  # what `run` still had there ends, as in asyncio.run
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        finally:
            self._loop.close()
            if not self._first_round.done():
                self._first_round.set_result(None)
            self._ended.set_result(None)

    async def _main(self) -> None:
        async with httpx2.AsyncClient(verify=self.verify) as http:
            self._http = http
            refresher = asyncio.create_task(self._refresh_forever())
            await self._stop.wait()
            refresher.cancel()
            for task in [refresher, *self._health.values()]:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _refresh_forever(self) -> None:
        while True:
            await self.refresh()
            if not self._first_round.done():
                self._first_round.set_result(None)
            await asyncio.sleep(self.refresh_interval)

    async def refresh(self) -> None:
        """Take the source's current replica set: add the new, drain the gone."""
        try:
            urls = set(await self.source.urls())
        except (DiscoveryError, OSError) as exc:
            log.warning("replica discovery failed (keeping %d): %s", len(self.replicas), exc)
            return
        with self.lock:
            known = set(self.replicas)
            for url in urls - known:
                self.replicas[url] = Replica(url)
            for url in known - urls:
                del self.replicas[url]  # requests in flight there hold their own reference
        for url in urls - known:
            log.info("replica %s joined", url)
            self._health[url] = asyncio.create_task(self._check(self.replicas[url]))
        for url in known - urls:
            log.info("replica %s left", url)
            self._health.pop(url).cancel()
        if not urls:
            log.warning("replica discovery found no replica")

    def _check(self, replica: Replica) -> Coroutine[Any, Any, None]:
        if replica.url.startswith("grpc"):
            return watch_grpc(replica, self.health_interval)
        return poll_http(replica, self._http, self.health_interval)


def new_pool(
    replicas: Replicas | None, affinity: AffinityPolicy | RoundRobinPolicy | None
) -> ReplicaPool:
    """The pool a client or transport makes when it is given replicas rather than a pool."""
    if replicas is None:
        raise TypeError("give the replicas (URLs, or a dns:// or file: spec), or a pool")
    return ReplicaPool(replicas, affinity=affinity)


def _cancel_the_rest(loop: asyncio.AbstractEventLoop) -> None:
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


def _stats(replica: Replica) -> dict[str, Any]:
    stats = replica.stats
    return {
        **asdict(stats),
        "affinity_ratio": round(stats.affinity_ratio, 3),
        "in_flight": replica.in_flight,
        "queue_wait_ms": replica.queue_wait_ms,
        "ready": replica.ready,
        "breaker": replica.breaker.state,
    }
