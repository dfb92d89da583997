"""Continuous batching with one token budget per step and chunked prefill.

Each step: running requests first (one decode token each, or the next chunk of a prompt),
then waiting requests in the policy's order while the token budget, the sequence cap and
the KV pool allow. When the pool runs dry, the policy's victim is preempted by recompute:
its blocks are freed and it waits again with every token it has, prompt and output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zerohop.engine.block_pool import BlockPool
from zerohop.engine.policy import FCFSPolicy, SchedulingPolicy
from zerohop.engine.sequence import Sequence, Status


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens to compute this step, from seq.num_computed_tokens on

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the last token, so the step samples a new one."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

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
    ) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy if policy is not None else FCFSPolicy()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        assert seq.status is Status.WAITING
        self.policy.add(seq)

    def has_work(self) -> bool:
        return bool(self.running) or len(self.policy) > 0

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        displaced = self._displace_for_waiting(out)
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if len(out.preempted) == displaced:  # no request was preempted for KV blocks
            self._schedule_waiting(out, budget)
        return out

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

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            assert num_new > 0, "a running sequence always has a token to compute"
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
                i += 1
                continue
            if seq.status is Status.WAITING:  # it preempted itself: nothing else fits
                break
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.policy.peek()
            if seq is None:
                return
            hits = self.pool.match_prefix(seq)
            num_new = min(seq.num_tokens - len(hits) * self.pool.block_size, budget)
            if not self.pool.can_admit(seq, hits, num_new):
                return
            self.policy.remove(seq)
            self.policy.admitted(seq)
            self.pool.admit(seq, hits, seq.num_tokens)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            allocated = self.pool.allocate(seq, seq.num_computed_tokens + num_new)
            assert allocated, "can_admit promised room"
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.pool.release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.policy.requeue(seq)
        out.preempted.append(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """End a sequence (finished, aborted or failed) and return its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.policy.remove(seq)
        self.pool.release(seq)
        seq.finish(reason, stop_reason)
