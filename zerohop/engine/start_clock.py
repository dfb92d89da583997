"""The phases of an engine's start, each logged with its duration as it ends, so that a slow
start says where its time went (model file, kernels, weights, KV cache, warm-up)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger("zerohop.engine")


class StartClock:
    def __init__(self) -> None:
        self._last = time.monotonic()
        self.phases: dict[str, float] = {}  # phase: seconds, in the order they ran

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self.phases[phase] = round(now - self._last, 3)
        log.info("engine start: %s in %.2f s", phase, now - self._last)
        self._last = now

    @property
    def total(self) -> float:
        return round(sum(self.phases.values()), 3)


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), or None where unknown: what the
    interpreter and the imports took before any code of the engine ran."""
    try:
        stat = Path("/proc/self/stat").read_text()
        fields = stat.rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: since boot
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return None
