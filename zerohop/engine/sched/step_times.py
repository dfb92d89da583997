"""How long the engine's steps take by their size, learned online from its own steps.

A step costs what its decodes cost plus what its prompt tokens cost, and neither grows like
the recent load's rate: a decode step of 16 running requests takes barely more than one
request's (the weights are read once for the batch), and a prefill of 2,048 prompt tokens
about 16 times what 128 take. So each step is split into its two parts and each part is kept
by size, one bucket per power of two, as an exponentially weighted mean (EWMA) of the size
and the seconds of the steps that fell in it:

- `decode`: steps of decodes only, by the number of decoding requests;
- `prefill`: steps of prompt tokens, by their number; a step of both counts here with what
  the decode table says its decodes took taken off.

`StepCurve` turns a table into seconds for any size: linear between the sizes seen, the
smallest's time below them, and above the largest, the largest's time scaled linearly in
size (the most pessimistic it gets: a batch is never taken to cost more than linear in its
size, nor a step to be faster than a smaller one). The API process predicts a request's
queue wait from the two curves (zerohop.api.load.queue_model), and the scheduler sizes the prompt
tokens a step may carry beside running decodes from them (zerohop.engine.sched.prefill_budget).

Torch-free: the tables travel in the engine's stats (`EngineStats.step_times`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

DEFAULT_ALPHA = 0.2  # weight of the newest step in its bucket's mean


@dataclass(slots=True)
class Bucket:
    size: float
    seconds: float
    steps: int = 1

    def add(self, size: int, seconds: float, alpha: float) -> None:
        # The first steps of a bucket average plainly, so one outlier does not stick.
        weight = max(alpha, 1.0 / (self.steps + 1))
        self.size += weight * (size - self.size)
        self.seconds += weight * (seconds - self.seconds)
        self.steps += 1


@dataclass(slots=True)
class SizeTable:
    alpha: float = DEFAULT_ALPHA
    buckets: dict[int, Bucket] = field(default_factory=dict)  # by bit length of size - 1

    def add(self, size: int, seconds: float) -> None:
        if size <= 0 or seconds <= 0:
            return
        key = (size - 1).bit_length()  # 1 -> 0, 2 -> 1, 3..4 -> 2, 5..8 -> 3, ...
        bucket = self.buckets.get(key)
        if bucket is None:
            self.buckets[key] = Bucket(float(size), seconds)
        else:
            bucket.add(size, seconds, self.alpha)

    def rows(self) -> list[list[float]]:
        """[[size, seconds], ...] by size: each bucket's mean step."""
        return [[b.size, b.seconds] for _, b in sorted(self.buckets.items())]


@dataclass(slots=True, frozen=True)
class StepCurve:
    """Seconds by size, from a table's rows."""

    sizes: tuple[float, ...]  # ascending
    seconds: tuple[float, ...]  # nondecreasing

    @classmethod
    def from_rows(cls, rows: list[list[float]]) -> StepCurve | None:
        """None before a step of this kind has been measured."""
        points = sorted((float(n), float(s)) for n, s in rows if n > 0 and s > 0)
        if not points:
            return None
        sizes, seconds = [p[0] for p in points], [p[1] for p in points]
        # A step is never slower than a larger one: a small step that measured slower (the
        # first steps after start-up, a noisy neighbour) is brought down to the larger's.
        for i in range(len(seconds) - 2, -1, -1):
            seconds[i] = min(seconds[i], seconds[i + 1])
        return cls(tuple(sizes), tuple(seconds))

    def __call__(self, size: float) -> float:
        if size <= 0:
            return 0.0
        ns, ss = self.sizes, self.seconds
        if size <= ns[0]:
            return ss[0]
        if size >= ns[-1]:
            return ss[-1] * size / ns[-1]
        hi = bisect.bisect_left(ns, size)
        lo = hi - 1
        share = (size - ns[lo]) / (ns[hi] - ns[lo])
        return ss[lo] + share * (ss[hi] - ss[lo])

    def through_origin(self) -> StepCurve:
        """The same curve, but linear from (0, 0) up to the smallest size seen instead of flat
        below it: what sizes no step has had yet are taken to cost, per token, what the
        smallest measured did. A budget read from the flat curve would never try a smaller
        step than it has seen, and so never learn what one costs."""
        return StepCurve((0.0, *self.sizes), (0.0, *self.seconds))

    def largest_within(self, seconds: float, limit: int) -> int:
        """The largest whole size, at most `limit`, taken to cost at most `seconds` (0 when
        even the smallest seen costs more). The curve never falls, so a bisection finds it."""
        if limit <= 0 or self(1) > seconds:
            return 0
        lo, hi = 1, limit  # self(lo) <= seconds
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self(mid) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo


@dataclass(slots=True)
class StepTimes:
    decode: SizeTable = field(default_factory=SizeTable)
    prefill: SizeTable = field(default_factory=SizeTable)

    def record(self, tokens: int, seconds: float, decodes: int) -> None:
        """One step: `tokens` computed, `decodes` of them one request's next token each."""
        prompt = tokens - decodes
        if prompt <= 0:
            self.decode.add(decodes, seconds)
            return
        curve = StepCurve.from_rows(self.decode.rows()) if decodes else None
        decode_part = curve(decodes) if curve is not None else 0.0
        if seconds > decode_part:
            self.prefill.add(prompt, seconds - decode_part)

    def table(self) -> dict[str, list[list[float]]]:
        return {"decode": self.decode.rows(), "prefill": self.prefill.rows()}

    @classmethod
    def from_table(cls, table: dict[str, list[list[float]]]) -> StepTimes:
        """The figures `table()` gave, each row a first step of its size."""
        times = cls()
        for name, sizes in (("decode", times.decode), ("prefill", times.prefill)):
            for size, seconds in table.get(name, []):
                sizes.add(round(size), seconds)
        return times
