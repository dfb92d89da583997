"""How long a new request will wait before the engine starts it, at the batch it will run at.

The engine measures its steps by size (zerohop.engine.step_times: the mean time of a step of
about n tokens, per power of two of n) and sends the table with every step's stats. Here that
table becomes a curve, `StepCurve`: between the sizes seen, linear interpolation; below the
smallest, the smallest's time; above the largest, the largest's time scaled linearly in
tokens (the most pessimistic the model ever gets: a batch is never assumed to cost more than
linear in its size, and a larger step is never assumed faster than a smaller one).

A request's wait (`queue_wait`) is the time of the steps before the step that computes its
first prompt token:
- the step in progress (a decode of the running batch);
- the prompt tokens ahead of it, `max_num_batched_tokens` a step less the running requests'
  decode tokens, each step at the budget's size: a burst of 32 prompts ahead is two steps of
  2,048 tokens, not 4,096 tokens at the rate of one stream;
- when no slot is free for it (`max_num_seqs`, or KV blocks), the decode steps until enough
  running requests finish, at the running batch's size (from the quantiles of the running
  requests' output tokens left, `remaining_tokens`), the prompts ahead then costing what
  they add to those steps.
It is a few arithmetic operations on numbers the engine sent: cheap enough for every admission.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class StepCurve:
    """Seconds of one engine step by the tokens it computes."""

    tokens: tuple[float, ...]  # ascending
    seconds: tuple[float, ...]  # nondecreasing

    @classmethod
    def from_table(cls, table: list[list[float]]) -> StepCurve | None:
        """From `EngineStats.step_times`; None before the engine has measured a step."""
        points = sorted((float(t), float(s)) for t, s in table if t > 0 and s > 0)
        if not points:
            return None
        tokens, seconds = [p[0] for p in points], [p[1] for p in points]
        # A step is never slower than a larger one: a small step that measured slower (the
        # first steps after start-up, a noisy neighbour) is brought down to the larger's.
        for i in range(len(seconds) - 2, -1, -1):
            seconds[i] = min(seconds[i], seconds[i + 1])
        return cls(tuple(tokens), tuple(seconds))

    def __call__(self, tokens: float) -> float:
        if tokens <= 0:
            return 0.0
        ts, ss = self.tokens, self.seconds
        if tokens <= ts[0]:
            return ss[0]
        if tokens >= ts[-1]:
            return ss[-1] * tokens / ts[-1]
        hi = bisect.bisect_left(ts, tokens)
        lo = hi - 1
        share = (tokens - ts[lo]) / (ts[hi] - ts[lo])
        return ss[lo] + share * (ss[hi] - ss[lo])


@dataclass(slots=True, frozen=True)
class Ahead:
    """The work the scheduler would start before a request."""

    tokens: int  # prompt tokens to compute first
    requests: int  # requests that take a slot first


@dataclass(slots=True, frozen=True)
class EngineView:
    """What the engine's latest stats say about its batch."""

    curve: StepCurve
    running: int
    budget: int  # max_num_batched_tokens
    max_seqs: int
    blocks_free: int
    block_size: int
    remaining: tuple[int, ...]  # output tokens left of the running requests: quantiles

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any]) -> EngineView | None:
        curve = StepCurve.from_table(stats.get("step_times") or [])
        if curve is None:
            return None
        running = int(stats.get("num_running", 0))
        return cls(
            curve=curve,
            running=running,
            budget=max(1, int(stats.get("max_num_batched_tokens", 0))),
            max_seqs=int(stats.get("max_num_seqs", 0)) or running + 1_000_000,
            blocks_free=int(stats.get("blocks_free", 0)),
            block_size=max(1, int(stats.get("block_size", 0))),
            remaining=tuple(int(r) for r in stats.get("remaining_tokens") or ()),
        )

    def seats(self, prompt_tokens: int) -> int:
        """Requests that could start now without waiting for a running one to finish."""
        slots = self.max_seqs - self.running
        typical = self.remaining[-1] if self.remaining else 0
        growth = self.running * _mean(self.remaining) / self.block_size  # running ones' rest
        per_request = math.ceil((max(prompt_tokens, 1) + typical) / self.block_size)
        blocks = max(0.0, self.blocks_free - growth)
        return max(0, min(slots, int(blocks // per_request)))

    def decode_steps_until_finished(self, count: int) -> float:
        """Decode steps until `count` requests have finished and left their slots: the
        running ones first, by output left; then waves of requests as long as the longest."""
        if count <= 0 or not self.remaining:
            return 0.0
        if count <= self.running:
            return _quantile(self.remaining, (count - 1) / max(1, self.running - 1))
        waves = math.ceil((count - self.running) / max(1, self.running))
        return self.remaining[-1] * (1 + waves)


def queue_wait(view: EngineView, ahead: Ahead, prompt_tokens: int) -> float:
    """Seconds until the step that computes this request's first prompt token starts."""
    curve, running = view.curve, view.running
    in_progress = curve(running) if running else 0.0
    per_step = max(1, view.budget - running)
    prefill = (ahead.tokens // per_step) * curve(view.budget)
    short = ahead.requests + 1 - view.seats(prompt_tokens)
    if short <= 0:
        return in_progress + prefill
    decode = view.decode_steps_until_finished(short) * curve(running)
    added = ahead.tokens * (curve(view.budget) - curve(running)) / per_step
    return in_progress + max(prefill, decode + added)


def _mean(values: tuple[int, ...]) -> float:
    return sum(values) / len(values) if values else 0.0


def _quantile(ordered: tuple[int, ...], share: float) -> float:
    """The value a share of the way through `ordered` (ascending), interpolated."""
    position = share * (len(ordered) - 1)
    lo = math.floor(position)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (position - lo) * (ordered[hi] - ordered[lo])
