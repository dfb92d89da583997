"""The waiting queue of zerohop's scheduler class for vLLM (`FairShareQueue`, installed as vLLM's
`self.waiting`): zerohop's own `VTCPolicy` (or `FCFSPolicy`) driven with vLLM's requests, and
the settings the scheduler reads from the environment. zerohop.engine.vllm.scheduler says how
the two fit into vLLM's scheduler."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.request import Request, RequestStatus

from zerohop.engine.sched.background_share import DEFAULT_BACKGROUND_SHARE
from zerohop.engine.sched.fair_share import BACKGROUND, VTCPolicy
from zerohop.engine.sched.policy import FCFSPolicy
from zerohop.engine.sched.request_options import check_request_options
from zerohop.engine.vllm.request_tags import RequestTags

if TYPE_CHECKING:
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


def as_sequence(entry: Tagged) -> Sequence:
    """zerohop's policies are typed for its own `Sequence`; they read only what `Tagged` has."""
    return cast("Sequence", entry)


def tagged_of(seq: Sequence | None) -> Tagged | None:
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
        return tagged_of(self.policy.peek())

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
        entry = tagged_of(self.policy.peek())
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
        self.policy.admitted(as_sequence(entry))
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
            self.policy.requeue(as_sequence(entry))
        else:
            self.policy.add(as_sequence(entry))
        self._queued[entry.request.request_id] = entry
        self._count(entry, 1)

    def _remove(self, entry: Tagged) -> None:
        self.policy.remove(as_sequence(entry))
        del self._queued[entry.request.request_id]
        self._count(entry, -1)

    def _count(self, entry: Tagged, change: int) -> None:
        if entry.priority < BACKGROUND:
            self._foreground += change
