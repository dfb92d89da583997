"""How fast the engine has been working lately: tokens computed per second of step time.

The API process divides the work waiting ahead of a new request by this rate to estimate the
request's queue wait, and refuses at once when that is too long (see zerohop.api.overload).
Busy time, not wall time, is the denominator: an idle gap says nothing about speed.
"""

from __future__ import annotations

import time
from collections import deque


class ThroughputMeter:
    def __init__(self, window: float = 5.0) -> None:
        self.window = window
        self._steps: deque[tuple[float, int, float]] = deque()  # (end time, tokens, seconds)
        self._tokens = 0
        self._seconds = 0.0

    def record(self, tokens: int, seconds: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
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
