"""Scheduling policy: the order waiting requests are admitted in, and who is preempted.

The scheduler owns capacity (KV blocks, sequence slots, the token budget); a policy owns
order. `SchedulingPolicy` is the interface the scheduler calls, `FCFSPolicy` (first come,
first served) the plain one. The engine's default is `VTCPolicy` (fair_share.py): weighted
fair share between the tenants each request names, with priority classes
(`EngineConfig.scheduling_policy` picks "vtc" or "fcfs"; `LLM` also takes a policy object).
The engine calls `charge` once a step with the tokens each request processed, so a policy can
keep per-tenant counters at token granularity. Keys, rate limits and budgets are no policy's
job: the API process checks them at admission and charges the tokens the engine reports.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from zerohop.engine.sched.sequence import Sequence


@dataclass(slots=True, frozen=True)
class TokenUsage:
    """What one request consumed in one step."""

    request_id: str
    tenant: str
    prompt_tokens: int  # prompt (or recomputed) tokens prefilled this step
    output_tokens: int  # tokens sampled this step (0 or 1)
    cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission


class SchedulingPolicy(ABC):
    """Holds the waiting queue and decides admission order and preemption victims."""

    @abstractmethod
    def add(self, seq: Sequence) -> None:
        """A new request arrives."""

    @abstractmethod
    def requeue(self, seq: Sequence) -> None:
        """A preempted request goes back to waiting (it should be resumed early)."""

    @abstractmethod
    def peek(self) -> Sequence | None:
        """The request to admit next, without removing it."""

    @abstractmethod
    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the waiting queue (admitted or aborted)."""

    @abstractmethod
    def __len__(self) -> int: ...

    def victim(self, candidates: Seq[Sequence]) -> Sequence:
        """Which running request to preempt when blocks run out (default: newest)."""
        return max(candidates, key=lambda s: s.arrival)

    def displace(self, waiting: Sequence, running: Seq[Sequence]) -> Sequence | None:
        """Every sequence slot is taken and `waiting` is next: a running request to preempt
        so that it starts now, or None to let it wait for a slot (the default)."""
        return None

    def prompt_order(self, seq: Sequence) -> tuple[float, ...]:
        """The order prompt chunks take a step's prompt budget in, running or waiting (the
        smaller first); the default: arrival."""
        return (seq.arrival,)

    def admitted(self, seq: Sequence) -> None:  # noqa: B027 - optional hook
        """`seq` left the waiting queue to run (after `remove`)."""

    def charge(self, usage: Seq[TokenUsage]) -> None:  # noqa: B027 - optional hook
        """Called once per step with the tokens every request processed."""


class FCFSPolicy(SchedulingPolicy):
    """First come, first served; a preempted request resumes before newer ones."""

    def __init__(self) -> None:
        self.queue: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self.queue.append(seq)

    def requeue(self, seq: Sequence) -> None:
        self.queue.appendleft(seq)

    def peek(self) -> Sequence | None:
        return self.queue[0] if self.queue else None

    def remove(self, seq: Sequence) -> None:
        self.queue.remove(seq)

    def __len__(self) -> int:
        return len(self.queue)
