"""How fast the engine has been working: tokens per second of step time over the last
seconds, the time of each size of decode and of prefill (zerohop.engine.sched.step_times), and
the last step's time.

The API process predicts a new request's queue wait from the step times by size (see
zerohop.api.load.queue_model), and measures the wait it actually had with the last step's time
(the step that computed its first chunk). The recent rate is kept for /metrics only: the
rate of a light load says nothing about the rate of a full batch.
Busy time, not wall time, is the denominator: an idle gap says nothing about speed.
"""

from __future__ import annotations

import time
from collections import deque

from zerohop.engine.sched.step_times import StepTimes


class ThroughputMeter:
    def __init__(self, window: float = 5.0) -> None:
        self.window = window
        self._steps: deque[tuple[float, int, float]] = deque()  # (end time, tokens, seconds)
        self._tokens = 0
        self._seconds = 0.0
        self.step_times = StepTimes()
        self.last_step_seconds = 0.0

    def record(
        self, tokens: int, seconds: float, decodes: int = 0, now: float | None = None
    ) -> None:
        """One step of `tokens`, `decodes` of them decodes (the rest prompt tokens)."""
        now = time.monotonic() if now is None else now
        self.step_times.record(tokens, seconds, decodes)
        self.last_step_seconds = seconds
        self._steps.append((now, tokens, seconds))
        self._tokens += tokens
        self._seconds += seconds
        while len(self._steps) > 1 and self._steps[0][0] < now - self.window:
            _, old_tokens, old_seconds = self._steps.popleft()
            self._tokens -= old_tokens
            self._seconds -= old_seconds

    def tokens_per_second(self) -> float:
        """0.0 until a step has been measured."""
        return self._tokens / self._seconds if self._seconds > 0 else 0.0


def quantiles(values: list[int], points: int = 17) -> list[int]:
    """`values` sorted, cut to at most `points` evenly spaced ones (the first and the last
    kept): a fixed-size summary of a distribution that travels with every step's stats."""
    ordered = sorted(values)
    n = len(ordered)
    if n <= points:
        return ordered
    return [ordered[round(i * (n - 1) / (points - 1))] for i in range(points)]
