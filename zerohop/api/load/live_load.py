"""This replica's live load, one point per second for the last 15 minutes (the console's overview).

`GET /v1/admin/live?seconds=900` (docs/admin-api.md) answers `LiveLoad.window()`. Scraping
/metrics and keeping history needs a Prometheus; an operator looking at one replica right now
needs none, so the replica keeps its own short history in fixed memory:

- The request path tells it what happens: `on_tokens` on every engine step of every request
  (the hot path: two integer adds into the open second, no lock, as it runs on the event
  loop's thread) and `on_finished` once per request.
- `run()` closes the open second into a point once a second, with the engine's gauges
  (running, waiting, KV blocks) and its cumulative prefix-cache counters turned into
  per-second figures (a decrease means the engine restarted: its counters count from zero).
- The points live in a ring (`deque(maxlen=seconds)`); each one is bounded: a histogram of
  its TTFTs and one of its inter-token gaps (`latency_histogram`: log buckets, 9% wide) and
  `MAX_POINT_TENANTS` tenants (the rest summed as "other").

A point's rates divide by the time it covers (a late sample averages, never spikes). Its
latency percentiles cover the requests that finished in the trailing `window` seconds,
computed once when it closes; the whole ring's come from running totals of the histograms,
so answering the console costs the same whatever the traffic: `window(900)` is a few ms, and
`window(since=t)` (the console's poll each second) only the points after t.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise, takewhile
from typing import Any

from zerohop.api.load import latency_histogram as hist

log = logging.getLogger(__name__)

MAX_OPEN_GAPS = 65_536  # gaps held as floats in the open second before they are counted
MAX_POINT_TENANTS = 50  # tenants kept per point; the rest summed as OTHER
MAX_TENANTS = 20  # tenants in window(); the rest summed as OTHER
OTHER = "other"
REFUSED = (429, 503, 529)


@dataclass(slots=True)
class _Counts:
    """What one second saw; the open second's is added to on the request path."""

    requests: int = 0
    refusals: int = 0
    output_tokens: int = 0
    input_tokens: int = 0
    tenants: dict[str, int] = field(default_factory=dict)  # output tokens
    ttfts: list[float] = field(default_factory=list)  # the open second's, until it closes
    gaps: list[float] = field(default_factory=list)
    ttft_hist: hist.Histogram = field(default_factory=hist.empty)
    gap_hist: hist.Histogram = field(default_factory=hist.empty)

    def close(self) -> None:
        """Counts the second's TTFTs and gaps into its histograms."""
        for values, histogram in ((self.ttfts, self.ttft_hist), (self.gaps, self.gap_hist)):
            hist.add(histogram, values)
            values.clear()


@dataclass(slots=True)
class _Point:
    t: float  # unix seconds, when the point closed
    seconds: float  # the time it covers: the divisor of its rates
    c: _Counts
    running: int | None
    waiting: int | None
    kv_cache_use: float | None
    prefix_hit_rate: float | None
    trailing: tuple[float | None, ...] = (None,) * 4  # _LATENCY_KEYS, over the window


class LiveLoad:
    """The ring of points; called from one event loop's thread only."""

    def __init__(self, seconds: int = 900, window: float = 10.0) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 1:
            raise ValueError(f"seconds must be an integer >= 1, not {seconds!r}")
        if not window > 0:
            raise ValueError(f"window must be > 0, not {window!r}")
        self.capacity = seconds
        self.trailing = float(window)
        self.interval = 1.0
        self._points: deque[_Point] = deque(maxlen=seconds)
        self._open = _Counts()
        self._ttft_total, self._gap_total = hist.empty(), hist.empty()  # over the ring
        self._last_t: float | None = None
        self._prefix: tuple[int, int] | None = None  # the last (query, hit) counters seen

    def on_tokens(self, tenant: str, output_tokens: int) -> None:
        o = self._open
        o.output_tokens += output_tokens
        o.tenants[tenant] = o.tenants.get(tenant, 0) + output_tokens

    def on_finished(
        self,
        tenant: str,
        status: int,
        prompt_tokens: int,
        cached_tokens: int,
        ttft_s: float | None,
        token_times: Sequence[float],
    ) -> None:
        """A request ended, answered or refused (both count as requests): a refusal is a 429,
        503 or 529 before its prompt was read (`prompt_tokens` 0)."""
        o = self._open
        o.requests += 1
        if status in REFUSED and prompt_tokens == 0:
            o.refusals += 1
        o.input_tokens += max(0, prompt_tokens - cached_tokens)
        if ttft_s is not None:
            o.ttfts.append(ttft_s)
        if len(token_times) > 1:
            o.gaps.extend(b - a for a, b in pairwise(token_times))
            if len(o.gaps) > MAX_OPEN_GAPS:  # a flood of long answers: count them now
                hist.add(o.gap_hist, o.gaps)
                o.gaps.clear()

    def sample(self, engine_stats: Mapping[str, Any] | None, now: float | None = None) -> None:
        """Closes the open second into a point at unix time `now`; `engine_stats` None (the
        engine restarting) leaves its gauges null."""
        now = time.time() if now is None else now
        gauges = _gauges(engine_stats)
        hit_rate = self._prefix_rate(engine_stats)
        dt = now - self._last_t if self._last_t is not None else 0.0
        c, self._open, self._last_t = self._open, _Counts(), now
        c.tenants = _cap(c.tenants, MAX_POINT_TENANTS)
        c.close()
        point = _Point(now, dt if dt > 0 else self.interval, c, *gauges, hit_rate)
        if len(self._points) == self.capacity:  # the oldest leaves the totals with the ring
            self._count(self._points[0], -1)
        self._points.append(point)
        self._count(point, 1)
        recent = takewhile(lambda p: p.t > now - self.trailing, reversed(self._points))
        point.trailing = _percentiles(list(recent))

    def _count(self, point: _Point, sign: int) -> None:
        self._ttft_total += sign * point.c.ttft_hist
        self._gap_total += sign * point.c.gap_hist

    async def run(
        self, stats: Callable[[], Mapping[str, Any] | None], interval: float = 1.0
    ) -> None:
        """Samples every `interval` seconds until cancelled; a failing `stats()` samples None."""
        if not interval > 0:
            raise ValueError(f"interval must be > 0, not {interval!r}")
        self.interval = float(interval)
        loop = asyncio.get_running_loop()
        due = loop.time() + interval
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            due = max(due + interval, loop.time())  # a stalled loop skips, never bursts
            try:
                current = stats()
            except Exception:
                log.debug("live load: engine stats failed", exc_info=True)
                current = None
            self.sample(current)

    def window(self, seconds: int = 900, since: float | None = None) -> dict[str, Any]:
        """The last `seconds` points (fewer while the ring fills), JSON-ready; with `since`,
        only the points after that unix time (the summary still covers `seconds`)."""
        if isinstance(seconds, bool) or not isinstance(seconds, int):
            raise ValueError(f"seconds must be an integer, not {seconds!r}")
        if not 1 <= seconds <= self.capacity:
            raise ValueError(f"seconds must be in 1..{self.capacity}, not {seconds}")
        covered = list(self._points)[-seconds:]
        points = covered if since is None else [p for p in covered if p.t > since]
        return {
            "interval": self.interval,
            "t": [p.t for p in points],
            "requests_per_s": [_rate(p.c.requests, p) for p in points],
            "refusals_per_s": [_rate(p.c.refusals, p) for p in points],
            "output_tokens_per_s": [_rate(p.c.output_tokens, p) for p in points],
            "input_tokens_per_s": [_rate(p.c.input_tokens, p) for p in points],
            "running": [p.running for p in points],
            "waiting": [p.waiting for p in points],
            "kv_cache_use": [p.kv_cache_use for p in points],
            "prefix_hit_rate": [p.prefix_hit_rate for p in points],
            **{k: [p.trailing[i] for p in points] for i, k in enumerate(_LATENCY_KEYS)},
            "tenants": _tenant_series(points),
            "summary": self._summary(covered),
        }

    def _summary(self, covered: list[_Point]) -> dict[str, Any]:
        whole = len(covered) == len(self._points)
        totals = (self._ttft_total, self._gap_total) if whole else _totals(covered)
        return {
            "requests": sum(p.c.requests for p in covered),
            "output_tokens": sum(p.c.output_tokens for p in covered),
            **dict(zip(_LATENCY_KEYS, _quantiles(*totals), strict=True)),
        }

    def _prefix_rate(self, stats: Mapping[str, Any] | None) -> float | None:
        """The fraction of the prompt tokens looked up in the prefix cache since the last
        point that hit; None when none were (or without stats, or on the first point)."""
        if stats is None:
            return None
        try:
            query, hit = int(stats["prefix_query_tokens"]), int(stats["prefix_hit_tokens"])
        except (KeyError, TypeError, ValueError):
            return None
        last, self._prefix = self._prefix, (query, hit)
        if last is None:
            return None
        if query < last[0] or hit < last[1]:  # the engine restarted: it counts from zero
            last = (0, 0)
        queried, hits = query - last[0], hit - last[1]
        return min(1.0, hits / queried) if queried > 0 else None


_LATENCY_KEYS = ("ttft_p50", "ttft_p95", "itl_p50", "itl_p95")


def _gauges(stats: Mapping[str, Any] | None) -> tuple[int | None, int | None, float | None]:
    """(running, waiting, kv_cache_use) from the engine's stats; Nones without them."""
    if stats is None:
        return None, None, None
    try:
        running, waiting = int(stats["num_running"]), int(stats["num_waiting"])
        blocks, used = int(stats["num_blocks"]), int(stats["blocks_in_use"])
    except (KeyError, TypeError, ValueError):
        return None, None, None
    return running, waiting, (min(1.0, max(0.0, used / blocks)) if blocks > 0 else None)


def _totals(points: Sequence[_Point]) -> tuple[hist.Histogram, hist.Histogram]:
    return hist.total([p.c.ttft_hist for p in points]), hist.total([p.c.gap_hist for p in points])


def _quantiles(ttfts: hist.Histogram, gaps: hist.Histogram) -> tuple[float | None, ...]:
    return tuple(hist.percentile(h, q) for h in (ttfts, gaps) for q in (50, 95))


def _percentiles(points: Sequence[_Point]) -> tuple[float | None, ...]:
    return _quantiles(*_totals(points))


def _rate(count: int, point: _Point) -> float:
    return round(count / point.seconds, 3)


def _cap(counts: dict[str, int], limit: int) -> dict[str, int]:
    """The `limit` largest counts, the rest summed as OTHER."""
    if len(counts) <= limit:
        return counts
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    kept = dict(ranked[:limit])
    kept[OTHER] = kept.get(OTHER, 0) + sum(n for _, n in ranked[limit:])
    return kept


def _tenant_series(points: Sequence[_Point]) -> dict[str, list[float]]:
    """Output tokens/s per point of the MAX_TENANTS busiest tenants, the rest as OTHER."""
    totals: dict[str, int] = {}
    for p in points:
        for name, n in p.c.tenants.items():
            totals[name] = totals.get(name, 0) + n
    ranked = sorted(totals, key=lambda name: (-totals[name], name))
    counts = {name: [0] * len(points) for name in ranked[:MAX_TENANTS]}
    if len(ranked) > MAX_TENANTS:
        counts.setdefault(OTHER, [0] * len(points))
    for i, p in enumerate(points):
        for name, n in p.c.tenants.items():
            counts[name if name in counts else OTHER][i] += n
    return {
        name: [_rate(n, p) for n, p in zip(series, points, strict=True)]
        for name, series in counts.items()
    }
