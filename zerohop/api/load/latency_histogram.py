"""Latencies counted in log-spaced buckets, so percentiles over many seconds are sums.

The live load keeps one histogram of TTFTs and one of inter-token gaps per second; the
15 minutes' percentiles add up to 900 of them (one numpy sum), or come from a running total
kept as points enter and leave the ring, instead of sorting every sample on the event loop.
Buckets are 2^(1/8) wide (9%) from 0.1 ms to 1000 s; a percentile is read as its bucket's
geometric middle, within 4.5% of the nearest-rank value of the samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

LOWEST = 1e-4  # seconds: the first bucket's lower edge (anything below counts there)
PER_OCTAVE = 8
BUCKETS = math.ceil(math.log2(1e3 / LOWEST) * PER_OCTAVE)  # up to 1000 s
MIDDLES = LOWEST * 2 ** ((np.arange(BUCKETS) + 0.5) / PER_OCTAVE)

Histogram = np.ndarray  # int64 counts, BUCKETS long


def empty() -> Histogram:
    return np.zeros(BUCKETS, dtype=np.int64)


def add(histogram: Histogram, seconds: Sequence[float] | np.ndarray) -> None:
    """Count `seconds` (non-finite and negative values are dropped) into `histogram`."""
    values = np.asarray(seconds, dtype=np.float64)
    values = values[np.isfinite(values) & (values >= 0)]
    if values.size == 0:
        return
    index = np.floor(np.log2(np.maximum(values, LOWEST) / LOWEST) * PER_OCTAVE)
    np.add.at(histogram, np.clip(index.astype(np.int64), 0, BUCKETS - 1), 1)


def total(histograms: Sequence[Histogram]) -> Histogram:
    return np.sum(histograms, axis=0) if histograms else empty()


def percentile(histogram: Histogram, q: float) -> float | None:
    """The nearest-rank q-th percentile's bucket middle (seconds); None when empty."""
    count = int(histogram.sum())
    if count == 0:
        return None
    rank = max(1, math.ceil(q / 100 * count))
    index = int(np.searchsorted(np.cumsum(histogram), rank))
    return round(float(MIDDLES[index]), 6)
