"""How much background work (batch lines) a step with interactive streams may carry: rows
whose measured cost fits a share of the interactive step's own, so a stream beside a running
batch slows by about that share and no more.

On a CPU every row of a step costs its part of the step: on the default model at 2 threads a
decode step of one row took 7.3 ms and each further row ~3.4 ms, so the batch lines that fit
a decode step within the inter-token target, decoding in an interactive stream's steps, made
each of its tokens wait ~146 ms instead of ~10 ms (benchmarks/batches.py: TPOT 15x, a 32-token
answer 5.8x slower beside a batch). Rows are the wrong unit; time is the right one.

A step whose interactive requests decode earns `share` times what those decodes cost (the
engine's decode curve, zerohop.engine.sched.step_times). Background decodes join it while
the decode curve's rise from the interactive rows fits the credit, then background prompt
tokens while the prompt curve (through the origin) does, and what joins is spent. Once the
step has run, the estimate is replaced by what it measured: the step's time beyond the
interactive part's estimate is what the background rows cost (a step that mixes prompt
tokens with decodes leaves the one-call decode path, which the curves do not see). Credit
carries over between steps up to `CARRY_STEPS` steps' earnings, so a row that costs more
than one step earns still runs every few steps and the mean step stays within 1 + share
of the interactive one; once it reaches that cap the next row runs whatever its estimate, so
a curve that overrates a row cannot stop the batch. Unspent credit is dropped when no
background work was left out of the step. With nothing interactive running this is not
consulted: batch lines run freely.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from zerohop.engine.sched.step_times import StepCurve, StepTimes

# The interactive step's cost that background rows beside it may add, as a share of it. The
# target is interactive TPOT within 1.3x idle beside a batch; benchmarks/batches.py on the
# default model, two alternating runs each: 0.2 gave TPOT 1.34x and 1.43x (the steps' noise,
# and rows an estimate undercounts, come on top of the share), 0.1 gave 1.16x and 1.17x, for
# the batch's rate beside the stream falling from 0.14x to 0.10x its idle rate.
DEFAULT_BACKGROUND_SHARE = 0.1
# Steps of earnings credit may hold: rows dearer than one step's earnings run every few
# steps, and a burst after a pause is bounded by this many steps' share.
CARRY_STEPS = 8


@dataclass(slots=True)
class BackgroundShare:
    """`share`: of the interactive step's cost (0: background waits for idle steps);
    `step_times`: the engine's current measurements (replaced after warm-up)."""

    share: float
    step_times: Callable[[], StepTimes]
    credit: float = 0.0  # seconds background rows may still add
    _decode: StepCurve | None = None
    _prompt: StepCurve | None = None
    _base: float = 0.0
    _cap: float = 0.0
    _foreground: float = 0.0  # the planned step's interactive part, estimated
    _spent: float = 0.0  # what its background rows were estimated to cost

    def begin(self, foreground_decodes: int, foreground_prompt_tokens: int) -> None:
        """A step with this interactive work is being planned: earn its share."""
        times = self.step_times()
        self._decode = StepCurve.from_rows(times.decode.rows())
        prefill = StepCurve.from_rows(times.prefill.rows())
        self._prompt = prefill.through_origin() if prefill is not None else None
        self._base = self._decode(foreground_decodes) if self._decode is not None else 0.0
        prompt = self._prompt(foreground_prompt_tokens) if self._prompt is not None else 0.0
        self._foreground, self._spent = self._base + prompt, 0.0
        earned = self.share * self._foreground
        self._cap = CARRY_STEPS * earned
        self.credit = min(self.credit + earned, self._cap)

    def decodes(self, foreground_decodes: int, available: int) -> int:
        """How many of `available` background decodes join the step; their cost is spent."""
        if self.share <= 0:
            return 0
        if self._decode is None:  # nothing measured yet: no figure to bound them by
            return available
        taken = 0
        while taken < available:
            cost = self._decode(foreground_decodes + taken + 1) - self._base
            if cost > self.credit and (taken > 0 or not self._at_cap()):
                break
            taken += 1
        self._spend(self._decode(foreground_decodes + taken) - self._base)
        return taken

    def prompt_tokens(self, limit: int) -> int:
        """Background prompt tokens, at most `limit`, the step may carry now."""
        if self.share <= 0:
            return 0
        if self._prompt is None:
            return limit
        if self.credit <= 0:
            return 0
        within = self._prompt.largest_within(self.credit, limit)
        if within == 0 and self._at_cap():
            return min(1, limit)
        return within

    def _at_cap(self) -> bool:
        return self.credit >= self._cap > 0

    def spent_on_prompts(self, tokens: int) -> None:
        if self._prompt is not None and tokens > 0:
            self._spend(self._prompt(tokens))

    def _spend(self, seconds: float) -> None:
        self.credit -= seconds
        self._spent += seconds

    def took(self, seconds: float) -> None:
        """The planned step ran in `seconds`: its background rows cost what it took beyond
        the interactive part's estimate, not what they were estimated to."""
        if self._spent <= 0:
            return
        actual = max(0.0, seconds - self._foreground)
        self.credit = max(self.credit + self._spent - actual, -self._cap)
        self._spent = 0.0

    def settle(self, left_out: bool) -> None:
        """The step is planned; `left_out`: background work waits for a later step."""
        if not left_out:
            self.credit = min(self.credit, 0.0)
