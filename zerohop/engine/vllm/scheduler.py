"""zerohop's scheduling policy inside vLLM's v1 scheduler: `FairShareScheduler`, passed to vLLM
as `scheduler_cls="zerohop.engine.vllm.scheduler.FairShareScheduler"` (vLLM resolves the name
inside its EngineCore process). vLLM keeps everything it owns (KV blocks, prefix caching,
chunked prefill, the token budget, structured outputs, aborts, KV connectors); zerohop decides
the order.

Each request carries its tenant, fair-share weight and priority class in
`SamplingParams.extra_args` (`zerohop.engine.vllm.request_tags.RequestTags`).

Order. The waiting queue (`FairShareQueue`, installed as vLLM's `self.waiting`) is zerohop's
own `VTCPolicy` (zerohop.engine.sched.fair_share), driven with vLLM's requests: class first
(0 interactive, 1 batch, 2 background), then the Virtual Token Counter between tenants (the
backlogged tenant with the smallest counter; a tenant that becomes backlogged is lifted to the
smallest backlogged counter, or the last admitted tenant's; ties to the tenant backlogged most
recently, then arrival). `ZEROHOP_VLLM_POLICY=fcfs` swaps in zerohop's `FCFSPolicy` (arrival
order, as vLLM's default).

Charges. A request's tokens times the input weight when it is admitted (it moves from waiting
to running; a preempted request is charged again when it is re-admitted, its recomputation
being service too); every token the step delivers times the output weight; both divided by the
tenant's weight. The admission charge is made before vLLM looks at the next waiting request,
so one scheduling pass does not admit a tenant's whole backlog on an unchanged counter.

Preemption. Before each step the running list is sorted by (class, the tenant's counter,
arrival): vLLM preempts the last request of that list when KV blocks run out, so its victim is
the highest class, then the most-served tenant, then the newest (`VTCPolicy.victim`'s rule);
the same order gives least-served tenants the step's token budget first.

Background share. While any interactive or batch (class 0/1) request runs or waits, a step
schedules at most `cap = max(1, floor(share * max_num_seqs))` background requests (share 0:
none, background runs only in steps of its own): running background requests past the cap (in
the order above: least-served tenants, then oldest, run) sit the step out and keep their KV
blocks, and no background request is admitted while `cap` of them hold a slot. When every slot
is taken and the next waiting request is of a lower class number than a running one, that
running request is preempted (one a step, as zerohop's `VTCPolicy.displace` does for batch
work) so the waiting one starts now; with prefix caching on, its full blocks stay cached for
its return.

A request vLLM holds back because it is not ready (its grammar still compiling, a streaming
session waiting for input) is kept out of the fair-share order until it is ready, as zerohop's
engine queues a constrained request once its grammar compiled. A request whose tags cannot be
scheduled (a weight that is not a positive number, say) ends with an error at the next step;
the engine and the other requests go on.

Settings come from the environment, which vLLM's EngineCore process inherits from the API
process: ZEROHOP_VLLM_POLICY (`POLICY_ENV`: vtc | fcfs, default vtc),
ZEROHOP_VLLM_TOKEN_WEIGHTS (`TOKEN_WEIGHTS_ENV`: "input,output", default "1,2") and
ZEROHOP_VLLM_BACKGROUND_SHARE (`BACKGROUND_SHARE_ENV`: default 0.1, the default of zerohop's
--batch-step-share, here a share of slots). `FairShareSettings.to_env()` writes them,
`from_env()` reads and checks them (the API process can call it to refuse a bad value before
vLLM starts; the scheduler raises the same ValueError, and vLLM's engine fails to start).

vLLM's CPU platform turns async scheduling off, so there `Scheduler` is subclassed. Where vLLM
schedules asynchronously (CUDA by default), the same name builds `AsyncFairShareScheduler`, on
vLLM's `AsyncScheduler`.

What vLLM's scheduler leaves out of reach:
- Requests that hold KV blocks while they wait (a KV connector's loads, streaming sessions
  between inputs) sit in vLLM's own `kv_holding_waiting`, which vLLM drains first, in arrival
  order; they are charged when admitted all the same.
- A request vLLM sets aside for one step for a reason of its own (LoRA slots full, a KV
  connector undecided, stale async output) leaves the order and comes back at the front of its
  tenant's line; if it was its tenant's only waiting request, the tenant is lifted as any
  tenant that becomes backlogged.
- Preemption for KV blocks happens inside `Scheduler.schedule`, where vLLM takes the last
  running request (the sort above decides which that is); vLLM's `policy="priority"` (its
  own victim rule on `Request.priority`) is refused, and `Request.priority` is not read.
- `VTCPolicy.displace`'s rule within a class (a tenant with no slot takes one from a tenant
  over its weighted share) is not carried over: within a class, a tenant waits for a slot to
  free. The background share counts slots, not the measured step time of zerohop's engine.
- Under fcfs, a background request at the head whose share is spent holds the requests behind
  it too, as in zerohop's engine under fcfs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from itertools import chain
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.sched.fair_share import BACKGROUND, VTCPolicy
from zerohop.engine.sched.policy import FCFSPolicy, TokenUsage
from zerohop.engine.vllm.fair_queue import (
    BACKGROUND_SHARE_ENV,
    POLICIES,
    POLICY_ENV,
    TOKEN_WEIGHTS_ENV,
    FairShareQueue,
    FairShareSettings,
    Tagged,
    as_sequence,
)
from zerohop.engine.vllm.orphan_guard import guard_against_orphaning

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.outputs import ModelRunnerOutput


log = logging.getLogger(__name__)

__all__ = [
    "BACKGROUND_SHARE_ENV",
    "POLICIES",
    "POLICY_ENV",
    "TOKEN_WEIGHTS_ENV",
    "AsyncFairShareScheduler",
    "FairShareScheduler",
    "FairShareSettings",
]


class FairShareScheduler(Scheduler):
    """vLLM's scheduler with zerohop's order, charges, preemption order and background share
    (see the module's doc). Built by vLLM with its own arguments; settings from the
    environment."""

    fair_share: VTCPolicy | FCFSPolicy
    fair_queue: FairShareQueue

    def __new__(cls, *args: Any, **kwargs: Any) -> FairShareScheduler:
        """Where vLLM schedules asynchronously, the one name builds the async variant."""
        vllm_config: VllmConfig | None = kwargs.get("vllm_config", args[0] if args else None)
        if (
            cls is FairShareScheduler
            and vllm_config is not None
            and vllm_config.scheduler_config.async_scheduling
        ):
            cls = AsyncFairShareScheduler
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        guard_against_orphaning()  # this runs inside vLLM's EngineCore process
        if self.policy != SchedulingPolicy.FCFS:
            raise ValueError(
                "zerohop's FairShareScheduler orders requests itself: leave vLLM's scheduling"
                f" policy at fcfs (not {self.policy.value}); {POLICY_ENV} picks vtc or fcfs"
            )
        self.settings = FairShareSettings.from_env()
        if self.settings.policy == "vtc":
            self.fair_share = VTCPolicy(*self.settings.token_weights)
        else:
            self.fair_share = FCFSPolicy()
        self.background_cap = self.settings.background_cap(self.max_num_running_reqs)
        self._entries: dict[str, Tagged] = {}  # every request the scheduler holds, by id
        self._refused: set[str] = set()  # tags that cannot be scheduled: ended at next output
        self.fair_queue = FairShareQueue(self.fair_share, self._entry, self._hold)
        # Requests holding KV blocks (KV connector loads, streaming sessions) stay in vLLM's
        # own queue: vLLM drains it first, in arrival order, whatever the policy.
        self.waiting = self.fair_queue

    # vLLM's entry points.

    def add_request(self, request: Request) -> None:
        request_id = request.request_id
        if request_id not in self.requests:
            try:
                self._entries[request_id] = Tagged.of(request)
            except (InvalidRequestError, ValueError, KeyError, TypeError) as exc:
                log.warning("request %s: its scheduling tags are refused: %s", request_id, exc)
                self._entries[request_id] = Tagged.default(request)
                self._refused.add(request_id)
        super().add_request(request)
        if request_id in self._refused:
            # vLLM's set of requests to end with an error at the next output
            self.grammar_compile_error_reqs.add(request_id)

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        queue = self.fair_queue
        queue.promote(self._ready)
        self.running.sort(key=self._victim_order)  # vLLM preempts running[-1] first
        displaced = self._displace()
        queue.begin_step(self._bound_background(), {displaced} if displaced else set())
        out = super().schedule(throttle_prefills)
        admitted = queue.end_step()
        # Admissions from vLLM's queue of block holders, not seen by ours.
        new = chain(
            (data.req_id for data in out.scheduled_new_reqs),
            out.scheduled_cached_reqs.resumed_req_ids,
        )
        for request_id in new:
            entry = self._entries.get(request_id)
            if request_id not in admitted and entry is not None and self._known(entry):
                self.fair_share.admitted(as_sequence(entry))
        return out

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        usage = []
        for core_outputs in outputs.values():
            for out in core_outputs.outputs:
                entry = self._entries.get(out.request_id)
                if entry is None:
                    continue
                if out.new_token_ids:
                    usage.append(
                        TokenUsage(out.request_id, entry.tenant, 0, len(out.new_token_ids))
                    )
                if entry.request.is_finished():
                    self._forget(out.request_id)
        self.fair_share.charge(usage)  # prompts were charged at admission
        return outputs

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[Request]:
        finished = super().finish_requests(request_ids, finished_status)
        for request in finished:
            self._forget(request.request_id)
        return finished

    # The policy's view of requests.

    def _entry(self, request: Request) -> Tagged:
        entry = self._entries.get(request.request_id)
        if entry is None or entry.request is not request:
            try:
                entry = Tagged.of(request)
            except (InvalidRequestError, ValueError, KeyError, TypeError):
                entry = Tagged.default(request)
            self._entries[request.request_id] = entry
        return entry

    def _forget(self, request_id: str) -> None:
        self._entries.pop(request_id, None)
        self._refused.discard(request_id)

    def _known(self, entry: Tagged) -> bool:
        """Whether the policy has seen the entry's tenant (it charges only those)."""
        return not isinstance(self.fair_share, VTCPolicy) or entry.tenant in self.fair_share.weights

    def _hold(self, request: Request) -> bool:
        """Out of the policy's order: refused, or not ready to run."""
        return request.request_id in self._refused or self._is_blocked_waiting_status(
            request.status
        )

    def _ready(self, request: Request) -> bool:
        """vLLM's own readiness check (a grammar that failed is ended with an error by vLLM)."""
        if request.request_id in self._refused or not self._handle_blocked_waiting_request(request):
            return False
        self.deferred_waiting.discard(request)  # vLLM's set of held and set-aside requests
        return True

    def _victim_order(self, request: Request) -> tuple[Any, ...]:
        """The running order: vLLM preempts the last. `VTCPolicy.victim`'s key (class, the
        tenant's counter, arrival), or `FCFSPolicy`'s (arrival)."""
        entry = self._entry(request)
        if isinstance(self.fair_share, VTCPolicy):
            counter = self.fair_share.counters.get(entry.tenant, 0.0)
            return entry.priority, counter, entry.arrival
        return (entry.arrival,)

    # The background share.

    def _foreground_present(self) -> bool:
        return (
            self.fair_queue.has_foreground()
            or any(self._entry(r).priority < BACKGROUND for r in self.running)
            or any(self._entry(r).priority < BACKGROUND for r in self.kv_holding_waiting)
        )

    def _bound_background(self) -> float:
        """With interactive or batch work present, running background requests past the cap
        sit this step out (they keep their blocks); returns the background admissions left."""
        if not self._foreground_present():
            return math.inf
        background = [r for r in self.running if self._entry(r).priority >= BACKGROUND]
        for request in background[self.background_cap :]:
            # vLLM's running loop skips a request whose next eligible step is later; schedule()
            # advances current_step first, so +2 skips this call alone (as vLLM's
            # DiffusionAsyncScheduler does); max keeps a longer pipeline-parallel wait.
            request.next_decode_eligible_step = max(
                request.next_decode_eligible_step, self.current_step + 2
            )
        return self.background_cap - len(background)

    def _displace(self) -> str | None:
        """Every slot is taken and the next waiting request is of a lower class number than
        the last running one: preempt that one (by recompute) so the waiting one starts.
        Returns the preempted request's id: it is not re-admitted in the same step."""
        if not isinstance(self.fair_share, VTCPolicy) or not self.running:
            return None
        if self._pause_state != PauseState.UNPAUSED:
            return None
        slots_taken = len(self.running) + self.num_waiting_for_streaming_input
        if slots_taken < self.max_num_active_reqs:
            return None
        head = self.fair_queue.head()
        victim = self.running[-1]
        if head is None or self._entry(victim).priority <= head.priority:
            return None
        if not self._request_blocks_can_be_freed(victim):
            return None
        self.running.pop()
        self._preempt_request(victim, time.monotonic(), drop_stale_output=self.requires_kv_delivery)
        return victim.request_id


class AsyncFairShareScheduler(FairShareScheduler, AsyncScheduler):
    """`FairShareScheduler` on vLLM's `AsyncScheduler` (built by `FairShareScheduler(...)`
    where `scheduler_config.async_scheduling` is on)."""
