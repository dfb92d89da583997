"""Weighted fair share between tenants: the Virtual Token Counter (Sheng et al., "Fairness in
Serving Large Language Models", OSDI 2024), with priority classes above it.

Each tenant has a counter of the service it received: a request's tokens times `input_weight`
when it is admitted (as in the paper, so that one scheduling pass does not admit a tenant's
whole backlog on an unchanged counter), then each sampled token times `output_weight`, all
divided by the tenant's weight (a weight-2 tenant's counter grows half as fast, so it gets
twice the service). Admission takes the waiting request of the backlogged tenant with the smallest
counter, so a tenant that floods the server cannot hold back one that sends a request at a
time. A tenant that becomes backlogged again has its counter lifted to the smallest counter
among the backlogged tenants (or to the last admitted tenant's, when none is waiting), so it
cannot bank the service it did not use while idle. Its counter then ties with the tenant it
was lifted to, and ties go to the tenant backlogged most recently: the others were served up
to that counter while it waited for nothing, and a tie lost to a flooding tenant's older queue
cost the light tenant's request a whole step (75-185 ms on the default model under
benchmarks/fairness.py's flood, a quarter to a half of its idle TTFT) before its next charge
put the flood ahead.

Priority classes come first: class 0 (interactive) is admitted before class 1 (batch), which
is admitted before class 2 (background: the lines of Message Batches / OpenAI batches, on the
capacity the others leave), and preemption takes the highest class number first; within a
class, fair share decides (ties as above, then the request that arrived first). A
preempted request is charged again when it is re-admitted: its recomputation is service too.

Order alone does not help a tenant when every sequence slot is taken (`max_num_seqs`) by
requests of equal length that end together: it would wait for the next batch of endings.
So when slots are full, `displace` preempts one running request a step (by recompute) for
the next waiting one: a batch request for interactive work; within a class, a request of
the most-served tenant holding more than its weighted share of the slots, for a tenant that
holds none.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence as Seq

from zerohop.engine.sched.policy import SchedulingPolicy, TokenUsage
from zerohop.engine.sched.request_options import check_weight
from zerohop.engine.sched.sequence import Sequence

INTERACTIVE, BATCH, BACKGROUND = 0, 1, 2
PRIORITY_CLASSES = {"interactive": INTERACTIVE, "batch": BATCH}


class VTCPolicy(SchedulingPolicy):
    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0) -> None:
        assert input_weight >= 0 and output_weight >= 0
        self.input_weight, self.output_weight = input_weight, output_weight
        self.counters: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        # (priority class, tenant) -> its waiting requests, oldest first (requeued in front).
        self.queues: dict[tuple[int, str], deque[Sequence]] = {}
        self._waiting = 0
        self._last_admitted: str | None = None
        # Per tenant, minus the count of tenants backlogged before it last became backlogged:
        # the most recently backlogged sorts first among equal counters.
        self._backlogged: dict[str, int] = {}
        self._backlogs = 0

    def add(self, seq: Sequence) -> None:
        self._enqueue(seq, front=False)

    def requeue(self, seq: Sequence) -> None:
        self._enqueue(seq, front=True)

    def peek(self) -> Sequence | None:
        if not self._waiting:
            return None
        level = min(level for level, _ in self.queues)
        tenants = [tenant for lv, tenant in self.queues if lv == level]
        tenant = min(tenants, key=lambda t: self._rank(self.queues[(level, t)][0]))
        return self.queues[(level, tenant)][0]

    def _rank(self, seq: Sequence) -> tuple[float, int, int]:
        """Its tenant's counter, ties to the tenant backlogged last, then arrival."""
        tenant = seq.tenant
        return self.counters.get(tenant, 0.0), self._backlogged.get(tenant, 0), seq.arrival

    def remove(self, seq: Sequence) -> None:
        key = (seq.priority, seq.tenant)
        queue = self.queues[key]
        if queue and queue[0] is seq:  # admission takes the front: the common case
            queue.popleft()
        else:
            queue.remove(seq)
        self._waiting -= 1
        if not queue:
            del self.queues[key]

    def __len__(self) -> int:
        return self._waiting

    def victim(self, candidates: Seq[Sequence]) -> Sequence:
        """Batch work first, then the tenant served most, then the newest request."""
        return max(
            candidates, key=lambda s: (s.priority, self.counters.get(s.tenant, 0.0), s.arrival)
        )

    def prompt_order(self, seq: Sequence) -> tuple[float, ...]:
        """Prompt chunks by class, then the tenant served least, then arrival: fair share
        governs a step's prompt budget as it governs admission, so a light tenant's prompt
        is computed before a flooding tenant's running prompts take the step."""
        return (seq.priority, *self._rank(seq))

    def admitted(self, seq: Sequence) -> None:
        self._last_admitted = seq.tenant
        self._add_service(seq.tenant, seq.num_tokens * self.input_weight)

    def displace(self, waiting: Sequence, running: Seq[Sequence]) -> Sequence | None:
        """Batch work yields its slot to interactive work. Within a class, a tenant with no
        running request takes a slot from the most-served tenant holding more than its
        weighted share of the slots, rounded up. The victim's tenant keeps at least one slot,
        so it never displaces back."""
        lower = [s for s in running if s.priority > waiting.priority]
        if lower:
            return self.victim(lower)
        peers = [s for s in running if s.priority == waiting.priority]
        if any(s.tenant == waiting.tenant for s in peers):
            return None  # it holds a slot already: its next request waits its turn
        held = Counter(s.tenant for s in peers)
        total = sum(self.weights[t] for t in held) + self.weights[waiting.tenant]

        def share(tenant: str) -> int:  # rounded up: a tenant keeps a slot it is due
            return math.ceil(len(running) * self.weights[tenant] / total)

        over = [s for s in peers if held[s.tenant] > share(s.tenant)]
        return self.victim(over) if over else None

    def charge(self, usage: Seq[TokenUsage]) -> None:
        for u in usage:
            if u.output_tokens and u.tenant in self.counters:
                self._add_service(u.tenant, u.output_tokens * self.output_weight)

    def _add_service(self, tenant: str, service: float) -> None:
        self.counters[tenant] += service / self.weights[tenant]

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        check_weight(seq.weight)  # the engine checks at add time; a direct caller may not
        tenant = seq.tenant
        self.weights[tenant] = seq.weight
        if not self._is_waiting(tenant):
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), self._lift_floor())
            self._backlogs += 1
            self._backlogged[tenant] = -self._backlogs
        queue = self.queues.setdefault((seq.priority, tenant), deque())
        if front:
            queue.appendleft(seq)
        else:
            queue.append(seq)
        self._waiting += 1

    def _is_waiting(self, tenant: str) -> bool:
        return any(t == tenant for _, t in self.queues)

    def _lift_floor(self) -> float:
        waiting = {t for _, t in self.queues}
        if waiting:
            return min(self.counters[t] for t in waiting)
        if self._last_admitted is not None:
            return self.counters.get(self._last_admitted, 0.0)
        return 0.0
