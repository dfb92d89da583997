"""The replicas a client may use, kept current in the background.

A daemon thread runs an event loop of its own: it asks the discovery source for the replica
set every `refresh_interval` seconds and keeps one health task per replica (gRPC Watch or
`GET /ready`). Replicas that appear join the pool at once; replicas that disappear stop
getting new requests, while the requests already there finish. Choosing a replica reads this
state under a lock and never waits for the network. The sync httpx transport also runs its
requests on this loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import asdict
from typing import Any, TypeVar

import httpx2

from zerohop.client.affinity import AffinityPolicy, RoundRobinPolicy
from zerohop.client.discovery import DiscoveryError, Source, StaticSource, source_from_spec
from zerohop.client.health import poll_http, watch_grpc
from zerohop.client.replica import Replica

log = logging.getLogger(__name__)
T = TypeVar("T")

Replicas = str | Sequence[str] | Source  # a spec ("dns://...", "file:..."), URLs, or a Source


def as_source(replicas: Replicas) -> Source:
    if isinstance(replicas, str):
        return source_from_spec(replicas)
    if isinstance(replicas, Sequence):
        return StaticSource(list(replicas))
    return replicas


class ReplicaPool:
    def __init__(
        self,
        replicas: Replicas,
        *,
        affinity: AffinityPolicy | RoundRobinPolicy | None = None,
        refresh_interval: float = 2.0,
        health_interval: float = 1.0,
        verify: bool | str = True,
    ) -> None:
        """`verify`: TLS certificate checks for `https://` replicas (False, or a CA bundle's
        path), for requests and health checks alike."""
        self.source = as_source(replicas)
        self.verify = verify
        self.affinity = affinity or AffinityPolicy()
        self.refresh_interval = refresh_interval
        self.health_interval = health_interval
        self.replicas: dict[str, Replica] = {}
        self.lock = threading.Lock()
        self.rng = random.Random()
        self._health: dict[str, asyncio.Task] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="zerohop-client", daemon=True)
        self._started = threading.Event()
        self._first_refresh = threading.Event()
        self._thread.start()
        self._started.wait()
        self._first_refresh.wait(timeout=5.0)

    # -- choosing ----------------------------------------------------------------------

    def choose(self, prompt: str, exclude: set[str]) -> tuple[Replica, bool]:
        """A replica for `prompt` among those not in `exclude` (LookupError: none left),
        counted as in flight until `release`."""
        with self.lock:
            candidates = [r for url, r in self.replicas.items() if url not in exclude]
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
        """Run `coroutine` on the pool's loop from another thread, and wait for it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def close(self) -> None:
        if self._loop.is_closed() or not self._thread.is_alive():
            return
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()
        self._started.set()
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

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
            self._first_refresh.set()
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
