"""Overload: refuse at once, cheaply, what the engine cannot start in time.

A proxy in front of a server can only count requests; here the API process sees the engine's
queue. A new request's wait is estimated as the work queued ahead of it over the engine's
recent speed: the prompt tokens of the requests sent but not yet started that the scheduler
would take first (`AdmissionControl._work_ahead`), plus the decode tokens the running
requests will add meanwhile (one per running request per step, with
`max_num_batched_tokens` tokens a step), divided by the tokens per second of step time the
engine measured over its last seconds. Past `max_queue_wait`, or with `max_waiting` requests
already queued, the request is refused with Anthropic's 529 `overloaded_error`, OpenAI's 503 or
gRPC UNAVAILABLE, and a `retry-after`, so the official SDKs back off and retry (and a
multi-replica client tries another replica). Overload is not ill health: `/ready` and the gRPC
health service stay SERVING.

Every response also carries the replica's load: `zerohop-queue-wait-ms` (the wait behind the
whole queue), `zerohop-running`, `zerohop-waiting` and `zerohop-kv-usage`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerohop.api.errors import ApiError
from zerohop.engine.async_engine import AsyncEngine, Queued

DEFAULT_MAX_QUEUE_WAIT = 30.0  # seconds; the SDKs' own timeouts are 10 minutes
DEFAULT_MAX_WAITING = 512


@dataclass(slots=True, frozen=True)
class Load:
    queue_wait: float | None  # seconds; None until the engine has measured its speed
    running: int
    waiting: int
    kv_usage: float  # share of KV blocks holding live requests

    def headers(self) -> list[tuple[bytes, bytes]]:
        wait = "" if self.queue_wait is None else str(round(self.queue_wait * 1000))
        pairs = [
            (b"zerohop-running", str(self.running).encode()),
            (b"zerohop-waiting", str(self.waiting).encode()),
            (b"zerohop-kv-usage", f"{self.kv_usage:.3f}".encode()),
        ]
        return [(b"zerohop-queue-wait-ms", wait.encode()), *pairs] if wait else pairs


class AdmissionControl:
    def __init__(
        self,
        engine: AsyncEngine,
        max_queue_wait: float | None = DEFAULT_MAX_QUEUE_WAIT,
        max_waiting: int | None = DEFAULT_MAX_WAITING,
        fair_share: bool = True,
    ) -> None:
        self.engine = engine
        self.max_queue_wait = max_queue_wait or None  # 0 turns it off
        self.max_waiting = max_waiting or None
        self.fair_share = fair_share  # the engine's policy: vtc (True) or fcfs

    def load(self, request: Queued | None = None) -> Load:
        """The replica's load; with `request`, the queue wait that request would see."""
        engine = self.engine
        stats = engine.latest_stats or {}
        running = int(stats.get("num_running", 0))
        blocks = max(1, int(stats.get("num_blocks", 1)))
        ahead = self._work_ahead(request)
        return Load(
            queue_wait=self._queue_wait(stats, running, ahead),
            running=running,
            waiting=len(engine.queued),
            kv_usage=int(stats.get("blocks_in_use", 0)) / blocks,  # blocks live requests hold
        )

    def _work_ahead(self, request: Queued | None) -> int:
        """Prompt tokens queued that would be computed before `request`. Under fair share
        that is every higher class's, and of its own class, its tenant's queue times the
        weights of the backlogged tenants over its own (they take turns): a tenant that
        floods the queue waits behind its own flood, not the others."""
        queued = list(self.engine.queued.values())
        if request is None or not self.fair_share:
            return sum(q.prompt_tokens for q in queued)
        higher = sum(q.prompt_tokens for q in queued if q.priority < request.priority)
        peers = [q for q in queued if q.priority == request.priority]
        own = sum(q.prompt_tokens for q in peers if q.tenant == request.tenant)
        weights = {q.tenant: q.weight for q in peers} | {request.tenant: request.weight}
        turns = sum(weights.values()) / request.weight
        return higher + min(sum(q.prompt_tokens for q in peers), round(own * turns))

    @staticmethod
    def _queue_wait(stats: dict, running: int, ahead: int) -> float | None:
        speed = float(stats.get("tokens_per_second", 0.0))
        if speed <= 0:
            return None
        budget = max(1, int(stats.get("max_num_batched_tokens", 0)) - running)
        decode_tokens = running * math.ceil(ahead / budget)
        return (ahead + decode_tokens) / speed

    def check(self, surface: str, request: Queued) -> None:
        """Raise the surface's overload error when `request` should be refused."""
        load = self.load(request)
        if self.max_waiting is not None and load.waiting >= self.max_waiting:
            self._refuse(surface, load, f"{load.waiting} requests are already waiting")
        wait = load.queue_wait
        if self.max_queue_wait is not None and wait is not None and wait > self.max_queue_wait:
            self._refuse(surface, load, f"the queue wait would be {wait:.1f} s")

    def _refuse(self, surface: str, load: Load, why: str) -> None:
        status = 529 if surface == "anthropic" else 503
        retry = 1.0
        if load.queue_wait is not None and self.max_queue_wait is not None:
            retry = max(1.0, load.queue_wait - self.max_queue_wait)
        headers = [
            (b"retry-after", str(math.ceil(retry)).encode()),
            (b"retry-after-ms", str(int(retry * 1000)).encode()),
            (b"x-should-retry", b"true"),
        ]
        message = f"this replica is overloaded ({why}); retry later or on another replica"
        raise ApiError(status, message, code="overloaded", headers=headers)
