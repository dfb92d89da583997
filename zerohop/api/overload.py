"""Overload: refuse at once, cheaply, what the engine cannot start in time.

A proxy in front of a server can only count requests; here the API process sees the engine's
queue. A new request's wait is estimated as the work queued ahead of it over the engine's
recent speed: the prompt tokens of every request sent but not yet started, plus the decode
tokens the running requests will add meanwhile (one per running request per step, with
`max_num_batched_tokens` tokens a step), divided by the tokens per second of step time the
engine measured over its last seconds. Past `max_queue_wait`, or with `max_waiting` requests
already queued, the request is refused with Anthropic's 529 `overloaded_error`, OpenAI's 503 or
gRPC UNAVAILABLE, and a `retry-after`, so the official SDKs back off and retry (and a
multi-replica client tries another replica). Overload is not ill health: `/ready` and the gRPC
health service stay SERVING.

Every response also carries the replica's load: `zerohop-queue-wait-ms`, `zerohop-running`,
`zerohop-waiting` and `zerohop-kv-usage`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerohop.api.errors import ApiError
from zerohop.engine.async_engine import AsyncEngine

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
    ) -> None:
        self.engine = engine
        self.max_queue_wait = max_queue_wait or None  # 0 turns it off
        self.max_waiting = max_waiting or None
        self.refused = 0

    def load(self) -> Load:
        engine = self.engine
        stats = engine.latest_stats or {}
        running = int(stats.get("num_running", 0))
        blocks = max(1, int(stats.get("num_blocks", 1)))
        kv_usage = (
            int(stats.get("blocks_in_use", 0)) - int(stats.get("blocks_cached", 0))
        ) / blocks
        return Load(
            queue_wait=self._queue_wait(stats, running),
            running=running,
            waiting=engine.num_queued,
            kv_usage=kv_usage,
        )

    def _queue_wait(self, stats: dict, running: int) -> float | None:
        speed = float(stats.get("tokens_per_second", 0.0))
        if speed <= 0:
            return None
        queued = self.engine.queued_tokens
        budget = max(1, int(stats.get("max_num_batched_tokens", 0)) - running)
        decode_tokens = running * math.ceil(queued / budget)
        return (queued + decode_tokens) / speed

    def check(self, surface: str) -> Load:
        """The current load, or an ApiError when a new request should be refused."""
        load = self.load()
        if self.max_waiting is not None and load.waiting >= self.max_waiting:
            self._refuse(surface, load, f"{load.waiting} requests are already waiting")
        wait = load.queue_wait
        if self.max_queue_wait is not None and wait is not None and wait > self.max_queue_wait:
            self._refuse(surface, load, f"the queue wait would be {wait:.1f} s")
        return load

    def _refuse(self, surface: str, load: Load, why: str) -> None:
        self.refused += 1
        status = 529 if surface == "anthropic" else 503
        retry = 1.0
        if load.queue_wait is not None and self.max_queue_wait is not None:
            retry = max(1.0, load.queue_wait - self.max_queue_wait)
        seconds = str(math.ceil(retry)).encode()
        headers = [
            (b"retry-after", seconds),
            (b"retry-after-ms", str(int(retry * 1000)).encode()),
            (b"x-should-retry", b"true"),
        ]
        message = f"this replica is overloaded ({why}); retry later or on another replica"
        raise ApiError(status, message, code="overloaded", headers=headers)
