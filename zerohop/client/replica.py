"""One replica as the client sees it: its reported load and a circuit breaker.

Every zerohop response carries the replica's load (`zerohop-queue-wait-ms`, `zerohop-running`,
`zerohop-waiting`, `zerohop-kv-usage`); the client keeps the latest, plus its own count of
requests in flight there. The breaker opens after `failure_threshold` consecutive connect
failures or 5xx answers, and lets one probe through (half-open) `reset_after` seconds later.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(slots=True)
class CircuitBreaker:
    failure_threshold: int = 3
    reset_after: float = 5.0  # seconds open before a probe is let through
    state: str = CLOSED
    failures: int = 0
    opened_at: float = 0.0

    def allows(self, now: float | None = None) -> bool:
        """Whether a request may go to the replica now (a half-open breaker lets one)."""
        if self.state == CLOSED:
            return True
        now = time.monotonic() if now is None else now
        if self.state == OPEN and now - self.opened_at >= self.reset_after:
            self.state = HALF_OPEN
            return True
        return False

    def succeeded(self) -> None:
        self.state, self.failures = CLOSED, 0

    def failed(self, now: float | None = None) -> None:
        self.failures += 1
        if self.state == HALF_OPEN or self.failures >= self.failure_threshold:
            self.state = OPEN
            self.opened_at = time.monotonic() if now is None else now


@dataclass(slots=True)
class ReplicaStats:
    """What this client did with one replica (readable from Python, and logged)."""

    requests: int = 0  # attempts sent there, continuations included
    failures: int = 0  # attempts that failed there (connect error, reset, 5xx, overload)
    failovers: int = 0  # requests moved away from it after a failure, before or mid-stream
    resumes: int = 0  # of those, streams that broke mid-answer and went on elsewhere
    by_affinity: int = 0  # first tries that went there because their prefix ranks it first

    @property
    def affinity_ratio(self) -> float:
        return self.by_affinity / self.requests if self.requests else 0.0


@dataclass(slots=True)
class Replica:
    url: str
    queue_wait_ms: float = 0.0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    in_flight: int = 0  # this client's requests there now
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    ready: bool | None = None  # the background health check's latest answer (None: not yet)
    stats: ReplicaStats = field(default_factory=ReplicaStats)

    @property
    def usable(self) -> bool:
        """Whether new requests may go there: not reported unready, breaker letting through."""
        return self.ready is not False and self.breaker.allows()

    def observe(self, headers: Mapping[str, str]) -> None:
        """Take the load a response reported (missing or malformed values are kept)."""
        self.queue_wait_ms = _number(headers.get("zerohop-queue-wait-ms"), self.queue_wait_ms)
        self.running = int(_number(headers.get("zerohop-running"), self.running))
        self.waiting = int(_number(headers.get("zerohop-waiting"), self.waiting))
        self.kv_usage = _number(headers.get("zerohop-kv-usage"), self.kv_usage)


def _number(text: str | None, default: float) -> float:
    try:
        return default if text is None else float(text)
    except ValueError:
        return default
