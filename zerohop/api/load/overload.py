"""Overload: refuse at once, cheaply, what the engine cannot start in time.

A proxy in front of a server can only count requests; here the API process sees the engine's
queue and how long the engine's steps take by their size. A new request's wait is predicted
(zerohop.api.load.queue_model) from the work the scheduler would start before it
(`AdmissionControl._work_ahead`: the prompt tokens and the requests sent but not started
that it would take first) at the batch sizes that work will run at, as the engine measured
them on its own steps: a burst after a quiet period is priced at a full batch's speed, not at
the recent single stream's; then scaled by what the measured waits of the requests admitted
before it taught (zerohop.api.load.wait_correction, whose upper figure admission compares). Past
`ADMISSION_HEADROOM` of `max_queue_wait`, or with `max_waiting` requests already queued, the
request is refused with Anthropic's 529 `overloaded_error`, OpenAI's 503 or gRPC UNAVAILABLE,
and a `retry-after`, so the official SDKs back off and retry (and a multi-replica client
tries another replica). Overload is not ill health: `/ready` and the gRPC
health service stay SERVING.

Every response also carries the replica's load: `zerohop-queue-wait-ms` (the wait behind the
whole queue), `zerohop-running`, `zerohop-waiting` and `zerohop-kv-usage`; an admitted one
also its own predicted wait, `zerohop-predicted-queue-wait-ms`, and the wait it had,
`zerohop-actual-queue-wait-ms` (see zerohop.api.load.queue_timing).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from zerohop.api.errors import ApiError
from zerohop.api.load.queue_model import Ahead, EngineView, queue_wait
from zerohop.api.load.queue_timing import QueueTiming
from zerohop.api.load.wait_correction import WaitCorrection
from zerohop.engine.client import Queued

DEFAULT_MAX_QUEUE_WAIT = 30.0  # seconds; the SDKs' own timeouts are 10 minutes
DEFAULT_MAX_WAITING = 512
# A request is admitted when its predicted wait is within this share of max_queue_wait: the
# prediction is a mean, and the steps it prices vary (measured on a shared 2-core machine:
# actual / predicted p90 about 1.1-1.2 under overload).
ADMISSION_HEADROOM = 0.8


@dataclass(slots=True, frozen=True)
class Load:
    queue_wait: float | None  # seconds; None until the engine has measured its speed
    model_wait: float | None  # the step-time model's figure, before the measured correction
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


class QueueSource(Protocol):
    """What admission reads of the engine (the supervisor's engine of the moment)."""

    @property
    def queued(self) -> dict[str, Queued]: ...

    @property
    def latest_stats(self) -> Mapping[str, Any] | None: ...  # an EngineStatsDict


class AdmissionControl:
    def __init__(
        self,
        engine: QueueSource,
        max_queue_wait: float | None = DEFAULT_MAX_QUEUE_WAIT,
        max_waiting: int | None = DEFAULT_MAX_WAITING,
        fair_share: bool = True,
    ) -> None:
        self.engine = engine
        self.max_queue_wait = max_queue_wait or None  # 0 turns it off
        self.max_waiting = max_waiting or None
        self.fair_share = fair_share  # the engine's policy: vtc (True) or fcfs
        self.correction = WaitCorrection()
        self._stats: Mapping[str, Any] | None = None
        self._engine_view: EngineView | None = None

    def load(self, request: Queued | None = None) -> Load:
        """The replica's load; with `request`, the queue wait that request would see."""
        engine = self.engine
        stats = engine.latest_stats or {}
        running = int(stats.get("num_running", 0))
        blocks = max(1, int(stats.get("num_blocks", 1)))
        view = self._view(stats)
        model = None
        if view is not None:
            prompt = 0 if request is None else request.prompt_tokens
            model = queue_wait(view, self._work_ahead(request), prompt)
        return Load(
            queue_wait=None if model is None else self.correction(model),
            model_wait=model,
            running=running,
            waiting=len(engine.queued),
            kv_usage=int(stats.get("blocks_in_use", 0)) / blocks,  # blocks live requests hold
        )

    def _view(self, stats: Mapping[str, Any]) -> EngineView | None:
        """The engine's batch as its latest stats say, parsed once per step's stats."""
        if stats is not self._stats:
            self._stats, self._engine_view = stats, EngineView.from_stats(stats)
        return self._engine_view

    def _work_ahead(self, request: Queued | None) -> Ahead:
        """Prompt tokens and requests queued that would start before `request`. Under fair
        share that is every higher class's, and of its own class, its tenant's queue times
        the weights of the backlogged tenants over its own (they take turns): a tenant that
        floods the queue waits behind its own flood, not the others."""
        queued = list(self.engine.queued.values())
        if request is None or not self.fair_share:
            return Ahead(sum(q.prompt_tokens for q in queued), len(queued))
        higher = [q for q in queued if q.priority < request.priority]
        peers = [q for q in queued if q.priority == request.priority]
        own = [q for q in peers if q.tenant == request.tenant]
        weights = {q.tenant: q.weight for q in peers} | {request.tenant: request.weight}
        turns = sum(weights.values()) / request.weight
        tokens = min(_tokens(peers), round(_tokens(own) * turns))
        requests = min(len(peers), round(len(own) * turns))
        return Ahead(_tokens(higher) + tokens, len(higher) + requests)

    def check(self, surface: str, request: Queued) -> Load:
        """Raise the surface's overload error when `request` should be refused; else its
        load, with the queue wait predicted for it."""
        load = self.load(request)
        if self.max_waiting is not None and load.waiting >= self.max_waiting:
            self._refuse(surface, load, f"{load.waiting} requests are already waiting")
        model, limit = load.model_wait, self.max_queue_wait
        if limit is not None and model is not None:
            likely = self.correction.upper(model)  # not the mean: see wait_correction
            if likely > limit * ADMISSION_HEADROOM:
                self._refuse(surface, load, f"the queue wait would be {likely:.1f} s")
        return load

    def timing(self, load: Load) -> QueueTiming:
        """An admitted request's timing, whose measured wait corrects later predictions."""
        return QueueTiming(load.queue_wait, load.model_wait, self.correction)

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


def _tokens(queued: list[Queued]) -> int:
    return sum(q.prompt_tokens for q in queued)
