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
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any, cast

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from zerohop.engine.errors import InvalidRequestError
from zerohop.engine.sched.background_share import DEFAULT_BACKGROUND_SHARE
from zerohop.engine.sched.fair_share import BACKGROUND, VTCPolicy
from zerohop.engine.sched.policy import FCFSPolicy, TokenUsage
from zerohop.engine.sched.request_options import check_request_options
from zerohop.engine.vllm.orphan_guard import guard_against_orphaning
from zerohop.engine.vllm.request_tags import RequestTags

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.outputs import ModelRunnerOutput

    from zerohop.engine.sched.sequence import Sequence

log = logging.getLogger(__name__)

POLICY_ENV = "ZEROHOP_VLLM_POLICY"  # vtc (default) | fcfs
TOKEN_WEIGHTS_ENV = "ZEROHOP_VLLM_TOKEN_WEIGHTS"  # "input,output" token weights, default "1,2"
BACKGROUND_SHARE_ENV = "ZEROHOP_VLLM_BACKGROUND_SHARE"  # of max_num_seqs, default 0.1
POLICIES = ("vtc", "fcfs")


@dataclass(slots=True, frozen=True)
class FairShareSettings:
    policy: str = "vtc"
    token_weights: tuple[float, float] = (1.0, 2.0)  # input, output token
    background_share: float = DEFAULT_BACKGROUND_SHARE

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"{POLICY_ENV} must be one of {', '.join(POLICIES)}, not {self.policy!r}"
            )
        weights = self.token_weights
        if (
            len(weights) != 2
            or not all(math.isfinite(w) and w >= 0 for w in weights)
            or max(weights) == 0
        ):
            raise ValueError(f"{TOKEN_WEIGHTS_ENV} must be two numbers >= 0, not both 0")
        share = self.background_share
        if not math.isfinite(share) or share < 0:
            raise ValueError(f"{BACKGROUND_SHARE_ENV} must be a finite number >= 0")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FairShareSettings:
        """The settings the environment names (os.environ by default); ValueError naming the
        variable for a value that cannot be used."""
        env = os.environ if environ is None else environ
        default = cls()
        policy = env.get(POLICY_ENV, "").strip().lower() or default.policy
        weights = default.token_weights
        if raw := env.get(TOKEN_WEIGHTS_ENV, "").strip():
            try:
                numbers = tuple(float(part) for part in raw.split(","))
            except ValueError:
                numbers = ()
            if len(numbers) != 2:
                raise ValueError(f"{TOKEN_WEIGHTS_ENV} must be two numbers, as 1,2; not {raw!r}")
            weights = (numbers[0], numbers[1])
        share = default.background_share
        if raw := env.get(BACKGROUND_SHARE_ENV, "").strip():
            try:
                share = float(raw)
            except ValueError:
                raise ValueError(f"{BACKGROUND_SHARE_ENV} must be a number, not {raw!r}") from None
        return cls(policy, weights, share)

    def to_env(self) -> dict[str, str]:
        """The environment that makes `from_env` return these settings."""
        return {
            POLICY_ENV: self.policy,
            TOKEN_WEIGHTS_ENV: ",".join(repr(float(w)) for w in self.token_weights),
            BACKGROUND_SHARE_ENV: repr(float(self.background_share)),
        }

    def background_cap(self, max_num_seqs: int) -> int:
        """Background requests a step with interactive or batch work may schedule."""
        if self.background_share <= 0:
            return 0
        return max(1, math.floor(self.background_share * max_num_seqs))


@dataclass(slots=True, eq=False)
class Tagged:
    """A vLLM request as zerohop's policies see it: what `VTCPolicy` and `FCFSPolicy` read of
    a queued `Sequence` (tenant, weight, priority, arrival, num_tokens), from its tags."""

    request: Request
    tenant: str
    weight: float
    priority: int
    arrival: float

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens

    @classmethod
    def of(cls, request: Request) -> Tagged:
        """Its tags, checked as zerohop's engine checks them (InvalidRequestError, or the
        ValueError, KeyError or TypeError of a malformed tag)."""
        params = request.sampling_params
        tags = RequestTags.from_extra_args(params.extra_args if params is not None else None)
        check_request_options(tags.tenant, tags.weight, tags.priority, None)
        return cls(request, tags.tenant, tags.weight, tags.priority, request.arrival_time)

    @classmethod
    def default(cls, request: Request) -> Tagged:
        tags = RequestTags()
        return cls(request, tags.tenant, tags.weight, tags.priority, request.arrival_time)


def _seq(entry: Tagged) -> Sequence:
    """zerohop's policies are typed for its own `Sequence`; they read only what `Tagged` has."""
    return cast("Sequence", entry)


def _tagged(seq: Sequence | None) -> Tagged | None:
    return cast("Tagged | None", seq)


class FairShareQueue(RequestQueue):
    """vLLM's waiting queue, in the order of a zerohop policy (`VTCPolicy` or `FCFSPolicy`).

    vLLM peeks at the head, then pops it either to admit it or to set it aside for the step
    (put back with `prepend_requests` when the step is planned). Which of the two it was shows
    at the next call: an admitted request is RUNNING by then, and is charged at once.
    Requests that `hold` names (not ready to run) stay out of the policy until `promote`
    finds them ready; the head is withheld (the queue reads as empty to vLLM's admission
    loop) when it is background work and `background_room` is spent, or in `excluded`.
    """

    def __init__(
        self,
        policy: VTCPolicy | FCFSPolicy,
        entry: Callable[[Request], Tagged],
        hold: Callable[[Request], bool],
    ) -> None:
        self.policy = policy
        self._entry = entry
        self._hold = hold
        self._queued: dict[str, Tagged] = {}  # in the policy, by request id
        self._held: dict[str, Tagged] = {}  # not ready: out of the policy, in arrival order
        self._foreground = 0  # class 0/1 requests queued or held
        self._popped: Tagged | None = None  # popped by vLLM, not yet known admitted or not
        self.admitted: set[str] = set()  # admitted from here since `begin_step`
        self.background_room: float = math.inf  # background admissions left in the step
        self.excluded: set[str] = set()  # not to be admitted in the step

    # The step's bounds.

    def begin_step(self, background_room: float, excluded: set[str]) -> None:
        self._settle()
        self.admitted = set()
        self.background_room = background_room
        self.excluded = excluded

    def end_step(self) -> set[str]:
        """The step is planned: the request ids admitted from this queue in it."""
        self._settle()
        self.background_room, self.excluded = math.inf, set()
        return self.admitted

    def promote(self, ready: Callable[[Request], bool]) -> None:
        """Held requests that are now ready join the policy (become backlogged), at the back."""
        for entry in [e for e in self._held.values() if ready(e.request)]:
            del self._held[entry.request.request_id]
            self._count(entry, -1)
            self._enqueue(entry, front=False)

    def head(self) -> Tagged | None:
        """The next request the policy would admit, bounds aside."""
        self._settle()
        return _tagged(self.policy.peek())

    def has_foreground(self) -> bool:
        return self._foreground > 0

    # vLLM's RequestQueue.

    def add_request(self, request: Request) -> None:
        self._settle()
        self._add(request, front=False)

    def prepend_request(self, request: Request) -> None:
        self._settle()
        self._add(request, front=True)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """As vLLM's FCFS queue: the last of `requests` ends up first."""
        self._settle()
        for request in requests:
            self._add(request, front=True)

    def pop_request(self) -> Request:
        self._settle()
        entry = self._admissible()
        if entry is None:
            raise IndexError("pop from an empty queue")
        self._remove(entry)
        self._popped = entry
        return entry.request

    def peek_request(self) -> Request:
        self._settle()
        entry = self._admissible()
        if entry is None:
            raise IndexError("peek from an empty queue")
        return entry.request

    def remove_request(self, request: Request) -> None:
        self._settle()
        request_id = request.request_id
        if (held := self._held.pop(request_id, None)) is not None:
            self._count(held, -1)
        elif (entry := self._queued.get(request_id)) is not None:
            self._remove(entry)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.remove_request(request)

    def __bool__(self) -> bool:
        """Whether vLLM may admit a request now (held ones and withheld heads aside)."""
        self._settle()
        return self._admissible() is not None

    def __len__(self) -> int:
        return len(self._queued) + len(self._held)

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request: the policy's in arrival order (its admission order changes
        with every charge), then the held ones."""
        entries = [*self._queued.values(), *self._held.values()]
        return iter([entry.request for entry in entries])

    # Inside.

    def _admissible(self) -> Tagged | None:
        entry = _tagged(self.policy.peek())
        if entry is None or entry.request.request_id in self.excluded:
            return None
        if entry.priority >= BACKGROUND and self.background_room <= 0:
            return None
        return entry

    def _settle(self) -> None:
        """The request vLLM popped last: admitted (now RUNNING) is charged; otherwise it was
        set aside for the step (it comes back with `prepend_requests`) or moved on to vLLM's
        queue of requests that hold KV blocks (a KV connector's load)."""
        entry, self._popped = self._popped, None
        if entry is None or entry.request.status != RequestStatus.RUNNING:
            return
        self.policy.admitted(_seq(entry))
        self.admitted.add(entry.request.request_id)
        if entry.priority >= BACKGROUND:
            self.background_room -= 1

    def _add(self, request: Request, front: bool) -> None:
        entry = self._entry(request)
        if self._hold(request):
            self._held[request.request_id] = entry
            self._count(entry, 1)
        else:
            self._enqueue(entry, front)

    def _enqueue(self, entry: Tagged, front: bool) -> None:
        if front:
            self.policy.requeue(_seq(entry))
        else:
            self.policy.add(_seq(entry))
        self._queued[entry.request.request_id] = entry
        self._count(entry, 1)

    def _remove(self, entry: Tagged) -> None:
        self.policy.remove(_seq(entry))
        del self._queued[entry.request.request_id]
        self._count(entry, -1)

    def _count(self, entry: Tagged, change: int) -> None:
        if entry.priority < BACKGROUND:
            self._foreground += change


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
                self.fair_share.admitted(_seq(entry))
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
