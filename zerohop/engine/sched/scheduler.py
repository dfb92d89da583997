"""Continuous batching with one token budget per step and chunked prefill.

Each step: the running requests' decodes first (one token each), then prompt chunks (the
next chunk of a running prompt, or a waiting request admitted in the policy's order) while
the token budget, the sequence cap and the KV pool allow. The token budget is
max_num_batched_tokens, lowered while requests are decoding to their tokens plus the prompt
tokens that fit beside them within the inter-token target (zerohop.engine.sched.
prefill_budget). Prompt chunks take that budget in the policy's `prompt_order` (fair share:
the least-served tenant's first), running and waiting alike: a running prompt ahead of the
next waiting request goes first, then the waiting requests, then the other running prompts.
When the pool runs dry, the policy's victim is preempted by recompute: its blocks are freed
and it waits again with every token it has, prompt and output.

Background requests (class BACKGROUND: batch lines) take only what foreground work leaves: a
step that computes a foreground prompt leaves them out (they keep their blocks); a step with
foreground decodes carries only the background rows whose measured cost fits a share of its
own (zerohop.engine.sched.background_share), so a stream beside a batch keeps its pace; and
a step of theirs alone waits `background_linger` after the last foreground step, so that a
client sending its next request right after an answer does not wait for their step either.
With nothing foreground running they run freely.

A policy hook that fails for one request (`remove`, `admitted` or `requeue` of that request)
fails that request only: it is taken out of the batch, its blocks freed, and reported in
`SchedulerOutput.failed`; what was planned before stays planned. Any other failure is
raised to the engine, which fails the step's requests (see `LLMEngine.step`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from zerohop.engine.sched.background_share import BackgroundShare
from zerohop.engine.sched.block_pool import BlockPool
from zerohop.engine.sched.fair_share import BACKGROUND
from zerohop.engine.sched.policy import FCFSPolicy, SchedulingPolicy
from zerohop.engine.sched.prefill_budget import PrefillBudget
from zerohop.engine.sched.sequence import Sequence, Status

log = logging.getLogger(__name__)
POLICY_FAILED = "the scheduling policy failed on this request"


class RequestFault(Exception):
    """A policy hook raised for one request; `in_policy`: it may still be in its queue."""

    def __init__(self, seq: Sequence, in_policy: bool) -> None:
        super().__init__(seq.request_id)
        self.seq, self.in_policy = seq, in_policy


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens to compute this step, from seq.num_computed_tokens on
    # Of those, proposed tokens (zerohop.engine.sched.speculative): the chunk is a decode of
    # 1 + num_draft rows, each with logits.
    num_draft: int = 0

    @property
    def is_decode(self) -> bool:
        """Its tokens run as decode rows (one token each, its last and any proposed)."""
        return self.num_tokens == 1 or self.num_draft > 0

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the last token, so the step samples a new one."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # finished with an error

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: SchedulingPolicy | None = None,
        prefill_budget: PrefillBudget | None = None,
        background_share: BackgroundShare | None = None,
    ) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy if policy is not None else FCFSPolicy()
        self.prefill_budget = prefill_budget  # None: the full budget in every step
        self.background_share = background_share  # None: background rows are not bounded
        self.running: list[Sequence] = []
        self.foreground_at = -math.inf  # monotonic time the last step with foreground work ended

    def add(self, seq: Sequence) -> None:
        assert seq.status is Status.WAITING
        self.policy.add(seq)
        if self.prefill_budget is not None:
            self.prefill_budget.demand.arrived(seq.num_tokens)

    def has_work(self) -> bool:
        return bool(self.running) or len(self.policy) > 0

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        try:
            self._plan(out)
        except RequestFault as fault:  # that request fails; the rest waits for the next step
            log.exception("scheduling policy failed on request %s", fault.seq.request_id)
            self._drop(fault, out)
        return out

    def stepped(self, out: SchedulerOutput) -> None:
        """A planned step has run: a step with foreground work starts the linger."""
        if any(_foreground(c.seq) for c in out.chunks):
            self.foreground_at = time.monotonic()

    def took(self, seconds: float) -> None:
        """The step last planned ran in `seconds` (the background share's measure)."""
        if self.background_share is not None:
            self.background_share.took(seconds)

    def background_hold(self, linger: float) -> float:
        """Seconds a step of background requests alone should wait yet: `linger` after the
        last step with foreground work ended, 0 when foreground work is there or there is
        nothing to run. A line whose prompt arrives in that time waits too: its prefill
        step is the longest there is."""
        waiting = self.policy.peek()
        if linger <= 0 or (waiting is None and not self.running):
            return 0.0
        if any(_foreground(s) for s in self.running) or (waiting and _foreground(waiting)):
            return 0.0
        return max(0.0, self.foreground_at + linger - time.monotonic())

    def _plan(self, out: SchedulerOutput) -> None:
        displaced = self._displace_for_waiting(out)
        if self._foreground_prompt_pending():
            return self._plan_foreground_first(out, displaced)
        if self.background_share is not None and self._background_beside_foreground():
            return self._plan_background_bounded(out, displaced, self.background_share)
        self._schedule_fairly(out, self.step_budget(), displaced)

    def _schedule_fairly(
        self,
        out: SchedulerOutput,
        budget: int,
        displaced: int,
        include: Callable[[Sequence], bool] = bool,
    ) -> int:
        """Decodes, then prompt chunks in the policy's prompt order (see the module's doc)."""
        budget = self._schedule_running(out, budget, include, _is_decode)
        waiting = self.policy.peek()
        if waiting is not None and include(waiting):
            first = self._prompt_order(waiting, in_policy=True)
            ahead = lambda seq: self._prompt_order(seq) < first  # noqa: E731
            budget = self._schedule_running(out, budget, include, ahead)
        if len(out.preempted) == displaced:  # no request was preempted for KV blocks
            budget = self._schedule_waiting(out, budget, include)
        return self._schedule_running(out, budget, include)

    def _plan_foreground_first(self, out: SchedulerOutput, displaced: int) -> None:
        """Background requests (batch lines) sit out a step that computes a foreground
        prompt, so its first token comes as soon as on an engine without them: none of
        theirs decodes or starts in it; they keep their blocks (or are the first preempted
        for it). If the prompt cannot start (no slot or blocks yet), they run as usual."""
        # The prompt's budget counts only the decodes that run beside it.
        budget = self._schedule_fairly(out, self.step_budget(_foreground), displaced, _foreground)
        if not any(_foreground(c.seq) and not c.is_decode for c in out.chunks):
            decodes = sum(1 for seq in self.running if _is_decode(seq))
            left = self._budget_beside(decodes) - out.num_tokens
            self._schedule_running(out, min(budget, left), _background)

    def _background_beside_foreground(self) -> bool:
        """Foreground requests run while background ones run or are next to start."""
        if not any(_foreground(seq) for seq in self.running):
            return False
        waiting = self.policy.peek()
        return any(_background(s) for s in self.running) or (
            waiting is not None and _background(waiting)
        )

    def _plan_background_bounded(
        self, out: SchedulerOutput, displaced: int, share: BackgroundShare
    ) -> None:
        """The foreground's step as if no background request were there, then the background
        decodes and prompt tokens whose measured cost fits the share the step earned."""
        budget = self._schedule_fairly(out, self.step_budget(_foreground), displaced, _foreground)
        decodes = sum(1 for c in out.chunks if c.is_decode)
        share.begin(decodes, out.num_tokens - decodes)
        lines = sum(1 for s in self.running if _background(s) and _is_decode(s))
        taken = share.decodes(decodes, min(lines, budget))
        budget = self._schedule_running(out, taken, _background, _is_decode) + budget - taken
        if taken == lines:  # prompts only once every started line has its decode
            before = out.num_tokens
            tokens = share.prompt_tokens(budget)
            left = self._schedule_running(out, tokens, _background)
            self._schedule_waiting(out, left, _background)
            share.spent_on_prompts(out.num_tokens - before)
        share.settle(self._background_left_out(out))

    def _background_left_out(self, out: SchedulerOutput) -> bool:
        scheduled = {id(c.seq) for c in out.chunks}
        if any(_background(s) and id(s) not in scheduled for s in self.running):
            return True
        waiting = self.policy.peek()
        return waiting is not None and _background(waiting)

    def _foreground_prompt_pending(self) -> bool:
        """A foreground prompt waits or is being computed while background requests run."""
        if not any(seq.priority >= BACKGROUND for seq in self.running):
            return False
        waiting = self.policy.peek()
        if waiting is not None and waiting.priority < BACKGROUND:
            return True
        return any(_foreground(seq) and not _is_decode(seq) for seq in self.running)

    def step_budget(self, include: Callable[[Sequence], bool] = bool) -> int:
        """Tokens this step may compute: every decode (of the requests `include` takes), and
        the prompt tokens the prefill budget allows beside them; max_num_batched_tokens when
        nothing decodes. The decodes count as output produced in the budget's measure of
        prompt demand."""
        decodes = sum(1 for seq in self.running if _is_decode(seq) and include(seq))
        if self.prefill_budget is not None:
            self.prefill_budget.demand.produced(decodes)
        return self._budget_beside(decodes)

    def _budget_beside(self, decodes: int) -> int:
        limit = self.max_num_batched_tokens
        if self.prefill_budget is None or decodes == 0 or decodes >= limit:
            return limit
        return decodes + self.prefill_budget.tokens(decodes, limit - decodes)

    def _hook(self, seq: Sequence, in_policy: bool, hook: Callable[[Sequence], None]) -> None:
        """Call a policy hook about `seq`; its failure is that request's alone."""
        try:
            hook(seq)
        except Exception as exc:
            raise RequestFault(seq, in_policy) from exc

    def _drop(self, fault: RequestFault, out: SchedulerOutput) -> None:
        seq = fault.seq
        out.chunks = [c for c in out.chunks if c.seq is not seq]
        if seq in self.running:
            self.running.remove(seq)
        if fault.in_policy:
            with contextlib.suppress(Exception):  # the policy failed on it already
                self.policy.remove(seq)
        self.pool.release(seq)
        seq.finish("error")
        seq.error = POLICY_FAILED
        out.failed.append(seq)

    def _displace_for_waiting(self, out: SchedulerOutput) -> int:
        """With every slot taken, the policy may preempt one running request (per step) so
        the next waiting one starts now instead of when a slot frees."""
        if len(self.running) < self.max_num_seqs:
            return 0
        waiting = self.policy.peek()
        victim = None if waiting is None else self.policy.displace(waiting, self.running)
        if victim is None:
            return 0
        self._preempt(victim, out)
        return 1

    def _schedule_running(
        self,
        out: SchedulerOutput,
        budget: int,
        include: Callable[[Sequence], bool] = bool,
        now: Callable[[Sequence], bool] = bool,
    ) -> int:
        """The running requests `include` takes and `now` picks, not yet scheduled: decodes
        in running order, prompt chunks in the policy's prompt order."""
        scheduled = {id(c.seq) for c in out.chunks}
        picked = [s for s in self.running if id(s) not in scheduled and include(s) and now(s)]
        picked.sort(key=lambda s: (False, ()) if _is_decode(s) else (True, self._prompt_order(s)))
        for seq in picked:
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING or id(seq) in scheduled:
                continue  # preempted for an earlier one's blocks
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            assert num_new > 0, "a running sequence always has a token to compute"
            if not _is_decode(seq):  # a prompt's chunk: the decodes not yet scheduled first
                num_new = min(num_new, budget - self._decodes_left(out, include))
                if num_new <= 0:
                    continue
            while not self.pool.allocate(seq, seq.num_computed_tokens + num_new):
                candidates = [s for s in self.running if id(s) not in scheduled]
                victim = self.policy.victim(candidates)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                scheduled.add(id(seq))
                out.chunks.append(ScheduledChunk(seq, num_new))
                budget -= num_new
                continue
            if seq.status is Status.WAITING:  # it preempted itself: nothing else fits
                break
        return budget

    def _decodes_left(self, out: SchedulerOutput, include: Callable[[Sequence], bool]) -> int:
        scheduled = {id(c.seq) for c in out.chunks}
        return sum(
            1 for s in self.running if _is_decode(s) and include(s) and id(s) not in scheduled
        )

    def _prompt_order(self, seq: Sequence, in_policy: bool = False) -> tuple[float, ...]:
        """The policy's prompt order; its failure is that request's alone."""
        try:
            return self.policy.prompt_order(seq)
        except Exception as exc:
            raise RequestFault(seq, in_policy) from exc

    def _schedule_waiting(
        self, out: SchedulerOutput, budget: int, include: Callable[[Sequence], bool] = bool
    ) -> int:
        while budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.policy.peek()
            if seq is None or not include(seq):
                return budget
            if seq.status is not Status.WAITING:  # its removal failed when it ended
                self.policy.remove(seq)  # once more; raising now fails the step
                continue
            hits = self.pool.match_prefix(seq)
            num_new = min(seq.num_tokens - len(hits) * self.pool.block_size, budget)
            if not self.pool.can_admit(seq, hits, num_new):
                return budget
            self._hook(seq, True, self.policy.remove)
            self._hook(seq, False, self.policy.admitted)
            self.pool.admit(seq, hits, seq.num_tokens)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            allocated = self.pool.allocate(seq, seq.num_computed_tokens + num_new)
            assert allocated, "can_admit promised room"
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
        return budget

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.pool.release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        out.preempted.append(seq)
        self._hook(seq, True, self.policy.requeue)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """End a sequence (finished, aborted or failed) and return its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            try:
                self.policy.remove(seq)
            except Exception:  # it ends anyway; `_schedule_waiting` retries if offered it
                log.exception("scheduling policy failed to remove request %s", seq.request_id)
        self.pool.release(seq)
        seq.finish(reason, stop_reason)


def _foreground(seq: Sequence) -> bool:
    return seq.priority < BACKGROUND


def _background(seq: Sequence) -> bool:
    return seq.priority >= BACKGROUND


def _is_decode(seq: Sequence) -> bool:
    """One token left to compute: its next output token (or a prompt's very last token)."""
    return seq.num_tokens - seq.num_computed_tokens == 1
