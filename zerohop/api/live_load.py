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
- The points live in a ring (`deque(maxlen=seconds)`); each one is bounded: at most
  `MAX_SAMPLES` TTFTs and `MAX_SAMPLES` inter-token gaps (uniform reservoir samples of that
  second's, so a busy second is represented, not stored) and `MAX_POINT_TENANTS` tenants
  (the rest summed as "other").

A point's rates divide by the time it covers (a late sample averages, never spikes). Its
latency percentiles cover the requests that finished in the trailing `window` seconds,
computed once when it closes: nearest-rank percentiles of the kept samples, the same as
`numpy.percentile(..., method="inverted_cdf")`, so exact until a second passes MAX_SAMPLES.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise, takewhile
from typing import Any

log = logging.getLogger(__name__)

MAX_SAMPLES = 256  # TTFTs and inter-token gaps kept per second (each), reservoir-sampled
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
    ttfts: list[float] = field(default_factory=list)  # a sample of ttfts_seen
    ttfts_seen: int = 0
    gaps: list[float] = field(default_factory=list)  # a sample of gaps_seen
    gaps_seen: int = 0


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
        self._rng = random.Random(0)
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
            o.ttfts_seen = _reservoir(o.ttfts, o.ttfts_seen, [ttft_s], self._rng)
        if len(token_times) > 1:
            gaps = [b - a for a, b in pairwise(token_times)]
            o.gaps_seen = _reservoir(o.gaps, o.gaps_seen, gaps, self._rng)

    def sample(self, engine_stats: Mapping[str, Any] | None, now: float | None = None) -> None:
        """Closes the open second into a point at unix time `now`; `engine_stats` None (the
        engine restarting) leaves its gauges null."""
        now = time.time() if now is None else now
        gauges = _gauges(engine_stats)
        hit_rate = self._prefix_rate(engine_stats)
        dt = now - self._last_t if self._last_t is not None else 0.0
        c, self._open, self._last_t = self._open, _Counts(), now
        c.tenants = _cap(c.tenants, MAX_POINT_TENANTS)
        point = _Point(now, dt if dt > 0 else self.interval, c, *gauges, hit_rate)
        self._points.append(point)
        recent = takewhile(lambda p: p.t > now - self.trailing, reversed(self._points))
        point.trailing = _percentiles(list(recent))

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

    def window(self, seconds: int = 900) -> dict[str, Any]:
        """The last `seconds` points (fewer while the ring fills), JSON-ready."""
        if isinstance(seconds, bool) or not isinstance(seconds, int):
            raise ValueError(f"seconds must be an integer, not {seconds!r}")
        if not 1 <= seconds <= self.capacity:
            raise ValueError(f"seconds must be in 1..{self.capacity}, not {seconds}")
        points = list(self._points)[-seconds:]
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
            "summary": {
                "requests": sum(p.c.requests for p in points),
                "output_tokens": sum(p.c.output_tokens for p in points),
                **dict(zip(_LATENCY_KEYS, _percentiles(points), strict=True)),
            },
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


def _reservoir(kept: list[float], seen: int, values: Sequence[float], rng: random.Random) -> int:
    """Adds `values` to `kept`, a uniform sample of at most MAX_SAMPLES of the `seen` values so
    far (Algorithm R); returns the new `seen`."""
    room = MAX_SAMPLES - len(kept)
    if room > 0:
        kept.extend(values[:room])
        seen += min(room, len(values))
        values = values[room:]
    for v in values:
        seen += 1
        j = rng.randrange(seen)
        if j < MAX_SAMPLES:
            kept[j] = v
    return seen


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


def _nearest_rank(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _percentiles(points: Sequence[_Point]) -> tuple[float | None, ...]:
    ttfts = sorted(v for p in points for v in p.c.ttfts)
    gaps = sorted(v for p in points for v in p.c.gaps)
    return tuple(_nearest_rank(s, q) for s in (ttfts, gaps) for q in (50, 95))


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
