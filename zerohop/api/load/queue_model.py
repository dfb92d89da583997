"""How long a new request will wait before the engine starts it, at the batch it will run at.

The engine times its steps by size (zerohop.engine.sched.step_times): decodes by the number of
requests decoding, prompt tokens by their number, each as a curve (`StepCurve`: linear
between the sizes seen, never more pessimistic than linear in size past them). A request's
wait (`queue_wait`) is the time of the steps before the step that computes its first prompt
token:
- the step in progress: the running batch's decodes and as much of the prompts ahead as fits
  (`max_num_batched_tokens` a step; the stats are a step old, so the prompts sent just before
  are taken to be in it);
- the rest of the prompts ahead, in whole steps of the budget less the running requests'
  decodes, each step its decodes plus its prompt tokens: a burst of 32 prompts of 128 tokens
  ahead is two steps of 2,048 tokens, not 4,096 tokens at one stream's rate;
- when no slot is free for it (`max_num_seqs`, or KV blocks), the decode steps of the running
  batch until enough running requests finish (from the quantiles of their output tokens left,
  `remaining_tokens`), plus what the prompts ahead add to those steps.
It is a few arithmetic operations on numbers the engine sent: cheap enough for every admission.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerohop.engine.sched.step_times import StepCurve


@dataclass(slots=True, frozen=True)
class Ahead:
    """The work the scheduler would start before a request."""

    tokens: int  # prompt tokens to compute first
    requests: int  # requests that take a slot first


@dataclass(slots=True, frozen=True)
class EngineView:
    """What the engine's latest stats say about its batch."""

    decode: StepCurve  # seconds of a step of n decodes
    prefill: StepCurve  # seconds of n prompt tokens in a step
    running: int
    budget: int  # max_num_batched_tokens
    max_seqs: int
    blocks_free: int
    block_size: int
    remaining: tuple[int, ...]  # output tokens left of the running requests: quantiles

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any]) -> EngineView | None:
        """None before the engine has timed a decode and a prefill."""
        times = stats.get("step_times") or {}
        decode = StepCurve.from_rows(times.get("decode") or [])
        prefill = StepCurve.from_rows(times.get("prefill") or [])
        if decode is None or prefill is None:
            return None
        running = int(stats.get("num_running", 0))
        return cls(
            decode=decode,
            prefill=prefill,
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
    decode, prefill = view.decode(view.running), view.prefill
    per_step = max(1, view.budget - view.running)
    first = min(ahead.tokens, per_step)
    whole, rest = divmod(ahead.tokens - first, per_step)
    in_progress = decode + prefill(first)
    steps = whole * (decode + prefill(per_step))
    short = ahead.requests + 1 - view.seats(prompt_tokens)
    if short <= 0:
        return in_progress + steps
    # No slot for it: it waits for `short` running requests to finish, decoding meanwhile;
    # the prompts ahead start as slots free, adding their prefill to those steps.
    decodes = view.decode_steps_until_finished(short) * decode
    added = whole * prefill(per_step) + prefill(rest)
    return in_progress + max(steps, decodes + added)


def _mean(values: tuple[int, ...]) -> float:
    return sum(values) / len(values) if values else 0.0


def _quantile(ordered: tuple[int, ...], share: float) -> float:
    """The value a share of the way through `ordered` (ascending), interpolated."""
    position = share * (len(ordered) - 1)
    lo = math.floor(position)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (position - lo) * (ordered[hi] - ordered[lo])
