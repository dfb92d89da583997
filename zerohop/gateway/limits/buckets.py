"""Rate limits with the Anthropic API's semantics: continuously refilled token buckets.

Each key and each tenant has up to three buckets, whose capacity is the per-minute figure
and which refill at capacity/60 per second: requests, input tokens, output tokens; plus a
count of requests in flight. A request is admitted only while every bucket that applies has
room: a request slot, its (uncached) input tokens, and a positive output balance. Input
tokens are charged at admission and the prefix-cache hits refunded when the engine reports
them; output tokens are charged as the engine produces them, so the output bucket may go
into debt, which later admissions wait out. `max_tokens` plays no part.

A limit of 0 allows nothing: every request is refused (429) with a message saying the limit
is 0 and no retry-after (`Refusal.retry_after` None), since waiting will not help; the
gateway adds `x-should-retry: false`, so the official SDKs do not retry it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from zerohop.gateway.keys.identity import LIMIT_FIELDS, Identity, Limits

# The bucket kinds, and the limits (their capacities) they are made of.
_BUCKETS = tuple((f.bucket, f.name) for f in LIMIT_FIELDS if f.bucket is not None)
KINDS = tuple(kind for kind, _ in _BUCKETS)  # requests, input_tokens, output_tokens
_LIMIT_OF = dict(_BUCKETS)  # bucket kind -> its limit's name (rpm, itpm, otpm)


@dataclass(slots=True)
class TokenBucket:
    capacity: float
    level: float
    updated: float

    @property
    def rate(self) -> float:
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until the bucket holds `amount` (capped at its capacity); 0 if it does."""
        missing = min(amount, self.capacity) - self.level
        return max(0.0, missing / self.rate)

    def seconds_to_full(self) -> float:
        if self.capacity <= 0:  # a limit of 0 is always as full as it gets
            return 0.0
        return max(0.0, (self.capacity - self.level) / self.rate)


@dataclass(slots=True)
class SubjectLimits:
    """The buckets and in-flight count of one key or tenant. In a fleet, `share` is this
    replica's part of each per-minute limit (`zerohop.gateway.limits.fleet_shares`): the buckets'
    capacity and refill are the limit times the share."""

    limits: Limits
    buckets: dict[str, TokenBucket] = field(default_factory=dict)
    in_flight: int = 0
    share: float = 1.0
    asked: float = 0.0  # requests asked for, in parts of the per-minute limits (fleet demand)
    asked_at: float = 0.0  # monotonic time of the last request asked for

    @classmethod
    def create(cls, limits: Limits, now: float, share: float = 1.0) -> SubjectLimits:
        state = cls(limits, share=share)
        for kind, name in _BUCKETS:
            if (limit := getattr(limits, name)) is not None:
                capacity = float(limit) * share
                state.buckets[kind] = TokenBucket(capacity, capacity, now)
        return state


@dataclass(slots=True, frozen=True)
class Refusal:
    reason: str  # rate_limit_requests | rate_limit_input_tokens | rate_limit_output_tokens
    #              | concurrency
    retry_after: float | None  # seconds; None: a limit of 0, waiting will not help
    message: str


@dataclass(slots=True, frozen=True)
class RateState:
    """The most restrictive figures for one bucket kind, for response headers."""

    limit: int
    remaining: int
    reset_after: float  # seconds until full


class RateLimiter:
    """Buckets by subject ("key:<id>", "tenant:<name>"). `admit` hands back the subjects it
    charged, and the request charges and releases those same objects afterwards, so the
    per-token path does no lookups; a subject's limits change in place."""

    def __init__(self, fleet: bool = False) -> None:
        self._subjects: dict[str, SubjectLimits] = {}
        # In a fleet a subject new to this replica holds no share until the store grants one.
        self.fleet = fleet

    def subjects(self) -> dict[str, SubjectLimits]:
        return self._subjects

    def peek(self, identity: Identity) -> list[tuple[str, SubjectLimits]]:
        """The limited subjects of `identity` (created if new), charging nothing."""
        return self._subjects_of(identity, time.monotonic())

    def _subjects_of(self, identity: Identity, now: float) -> list[tuple[str, SubjectLimits]]:
        pairs = []
        for name, limits in (
            (f"key:{identity.key_id}", identity.limits),
            (f"tenant:{identity.tenant.name}", identity.tenant.limits),
        ):
            if not limits.any():
                continue
            state = self._subjects.get(name)
            if state is None:
                share = 0.0 if self.fleet else 1.0
                state = self._subjects[name] = SubjectLimits.create(limits, now, share)
            elif state.limits != limits:  # changed in the store: resize, keep the levels
                _resize(state, limits, now)
            pairs.append((name, state))
        return pairs

    def admit(
        self, identity: Identity, input_tokens: int, now: float | None = None
    ) -> Refusal | list[SubjectLimits]:
        """Charge one request and its input tokens to every subject that has limits and
        return those subjects, or say which limit refuses and for how long."""
        now = time.monotonic() if now is None else now
        subjects = self._subjects_of(identity, now)
        for name, state in subjects:
            if self.fleet:
                state.asked += _demand(state.limits, input_tokens)
                state.asked_at = now
            refusal = self._check(name, state, input_tokens, now)
            if refusal is not None:
                return refusal
        for _, state in subjects:
            state.in_flight += 1
            if (bucket := state.buckets.get("requests")) is not None:
                bucket.level -= 1
            if (bucket := state.buckets.get("input_tokens")) is not None:
                bucket.level -= input_tokens
        return [state for _, state in subjects]

    @staticmethod
    def _check(name: str, state: SubjectLimits, input_tokens: int, now: float) -> Refusal | None:
        cap = state.limits.max_concurrency
        if cap == 0:
            return _zero("concurrency", name, "max_concurrency", "requests")
        if cap is not None and state.in_flight >= cap:
            return Refusal("concurrency", 1.0, f"{name}: {cap} requests in flight at most")
        needs = {"requests": 1.0, "input_tokens": float(input_tokens), "output_tokens": 1e-9}
        for kind, bucket in state.buckets.items():
            if getattr(state.limits, _LIMIT_OF[kind]) == 0:
                return _zero(f"rate_limit_{kind}", name, _LIMIT_OF[kind], kind.replace("_", " "))
            if bucket.capacity <= 0:  # a fleet's replica with no share (yet)
                message = (
                    f"{name}: this replica holds no share of the fleet's {_LIMIT_OF[kind]}"
                    " limit now: retry (on another replica, or here shortly)"
                )
                return Refusal(f"rate_limit_{kind}", 1.0, message)
            bucket.refill(now)
            wait = bucket.wait_for(needs[kind])
            if wait > 0:
                per_minute = int(bucket.capacity)
                what = kind.replace("_", " ")
                message = f"{name}: rate limit of {per_minute} {what} per minute reached"
                return Refusal(f"rate_limit_{kind}", wait, message)
        return None

    def state(self, identity: Identity, now: float | None = None) -> dict[str, RateState]:
        """Per kind, the bucket (of the key's and the tenant's) with the least room."""
        now = time.monotonic() if now is None else now
        out: dict[str, RateState] = {}
        for _, subject in self._subjects_of(identity, now):
            for kind, bucket in subject.buckets.items():
                bucket.refill(now)
                remaining = max(0, int(bucket.level))
                if kind not in out or remaining < out[kind].remaining:
                    out[kind] = RateState(int(bucket.capacity), remaining, bucket.seconds_to_full())
        return out


def _zero(reason: str, name: str, limit: str, what: str) -> Refusal:
    message = (
        f"{name}: its {limit} limit is 0, which allows no {what}: waiting will not help;"
        " the operator must raise the limit"
    )
    return Refusal(reason, None, message)


def refund_input(subjects: list[SubjectLimits], tokens: int) -> None:
    """Give back input tokens the prefix cache served (not charged, as cache reads)."""
    for state in subjects:
        if (bucket := state.buckets.get("input_tokens")) is not None:
            bucket.level = min(bucket.capacity, bucket.level + tokens)


def charge_output(subjects: list[SubjectLimits], tokens: int) -> None:
    for state in subjects:
        if (bucket := state.buckets.get("output_tokens")) is not None:
            bucket.level -= tokens  # may go into debt: later admissions wait it out


def undo_admission(subjects: list[SubjectLimits], input_tokens: int) -> None:
    """Give back what `admit` charged, for a request refused later (by its budget)."""
    release(subjects)
    for state in subjects:
        for kind, amount in (("requests", 1), ("input_tokens", input_tokens)):
            if (bucket := state.buckets.get(kind)) is not None:
                bucket.level = min(bucket.capacity, bucket.level + amount)


def release(subjects: list[SubjectLimits]) -> None:
    for state in subjects:
        state.in_flight = max(0, state.in_flight - 1)


def _resize(state: SubjectLimits, limits: Limits, now: float) -> None:
    """New limits or share, levels kept (capped at the new capacity); a bucket the subject
    did not have starts full."""
    fresh = SubjectLimits.create(limits, now, state.share)
    for kind, bucket in fresh.buckets.items():
        if (previous := state.buckets.get(kind)) is not None:
            previous.refill(now)
            bucket.level = min(bucket.capacity, previous.level)
    state.limits, state.buckets = limits, fresh.buckets


def set_share(state: SubjectLimits, share: float, now: float, *, fill: bool = False) -> None:
    """A fleet share granted or taken back. Added capacity starts empty (unless `fill`: the
    fleet's bucket had been idle, so full), so a replica's growing share never lets the
    fleet admit more than one bucket's worth plus its refill."""
    if share == state.share:
        return
    state.share = share
    _resize(state, state.limits, now)  # keeps the levels: what capacity grows by is empty
    if fill:
        for bucket in state.buckets.values():
            bucket.level = bucket.capacity


def _demand(limits: Limits, input_tokens: int) -> float:
    """What a request asks for, in parts of the subject's per-minute limits (the largest)."""
    parts = [1.0 / limits.rpm] if limits.rpm else []
    if limits.itpm:
        parts.append(input_tokens / limits.itpm)
    return max(parts, default=0.0)
