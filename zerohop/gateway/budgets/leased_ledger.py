"""Token budgets across a fleet: each replica spends slices of the budgets leased to it.

The fleet's ledger is in PostgreSQL (`zerohop.gateway.store.lease_tables`); a replica holds one
lease per (subject, period) it serves and reserves requests against it in memory, with no
network on the request path. `LeaseKeeper` (a thread, `zerohop.gateway.budgets.lease_keeper`)
renews the leases, tops them up before they run out, reports spend and gives back what
an idle replica does not need. A request the local lease cannot cover waits for a top-up
at most `lease_wait` seconds (`prepare`); then it is admitted inside what the lease holds
(clamped `max_tokens`, as with one replica), refused as over budget when the fleet has
nothing left, or refused as retryable (`LeaseUnavailable`) when the store cannot answer
or other replicas still hold the rest. It is never admitted beyond its lease.

A lease is spent only before its local deadline, which ends before PostgreSQL's: a
replica cut off from the store stops spending its leases before any other replica can be
granted what they held.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from dataclasses import dataclass, field

from zerohop.gateway.budgets.ledger import Keeper
from zerohop.gateway.budgets.sqlite_ledger import (
    BudgetExhausted,
    Reservation,
    budgets_of,
    period_key,
)
from zerohop.gateway.keys.identity import Identity

RATE_HALF_LIFE = 10.0  # seconds: how fast a lease's sizing follows its spend
PEAK_WINDOW = 60.0  # seconds: the largest recent reservation sizes the smallest lease


class LeaseUnavailable(Exception):
    """The local lease cannot cover the request now; another replica, or later, may."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(slots=True)
class Waiter:
    need: int  # prompt + max_tokens
    minimum: int  # prompt + 1: the least it can be admitted with (clamped)
    future: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop


@dataclass(slots=True)
class LocalLease:
    """This replica's slice of one budget. Fields change under `LeasedLedger.lock`: the
    loop reserves and settles, the keeper applies what PostgreSQL granted."""

    subject: str
    period: str
    limit: int  # the budget, as the key index has it now
    tenant: str = ""  # the tenant it counts for in metrics
    lease_id: int | None = None
    granted: int = 0  # never more than PostgreSQL counts as leased to this replica
    spent: int = 0  # final use of settled reservations
    open: int = 0  # reserved by requests in flight
    reported: int = 0  # `spent` as PostgreSQL last heard it
    reported_at: float = 0.0
    usable_until: float = 0.0  # monotonic: nothing is reserved on it after this
    free: int | None = None  # the fleet's unleased tokens at the last change; None: unknown
    held_elsewhere: int = 0  # other replicas' unreported leases at the last change
    answered_at: float = 0.0  # monotonic time of the last change PostgreSQL answered
    rate: float = 0.0  # tokens reserved per second, decaying average
    rate_at: float = field(default_factory=time.monotonic)
    peak: int = 0  # the largest reservation of the last PEAK_WINDOW seconds
    peak_at: float = 0.0
    last_reserved: float = field(default_factory=time.monotonic)
    waiters: list[Waiter] = field(default_factory=list)

    def available(self, now: float) -> int:
        if self.lease_id is None or now >= self.usable_until:
            return 0
        return self.granted - self.spent - self.open

    def target(self, horizon: float, now: float) -> int:
        """The slice worth holding: the recent spend over `horizon` seconds, and at least
        the largest recent request."""
        peak = self.peak if now - self.peak_at < PEAK_WINDOW else 0
        return max(peak, int(self._rate(now) * horizon))

    def scarce(self, horizon: float, now: float) -> bool:
        """The fleet has less unleased than this replica would hold: hold only what runs."""
        return self.free is not None and self.free < self.target(horizon, now)

    def note_reserved(self, tokens: int, now: float) -> None:
        self.rate = self._rate(now) + tokens / RATE_HALF_LIFE
        self.rate_at = now
        self.note_need(tokens, now)
        self.last_reserved = now

    def note_need(self, tokens: int, now: float) -> None:
        """A request of `tokens` came: the lease should hold at least that much."""
        if tokens >= self.peak or now - self.peak_at >= PEAK_WINDOW:
            self.peak, self.peak_at = tokens, now

    def _rate(self, now: float) -> float:
        return self.rate * math.pow(0.5, (now - self.rate_at) / RATE_HALF_LIFE)


class LeasedLedger:
    """BudgetLedger's interface over leases; `keeper` is set before `start`."""

    durability = "lease"
    failing = False  # no local journal to fail: unbudgeted requests are never held up
    commits = 0

    def __init__(self, lease_wait: float, horizon: float) -> None:
        self.lease_wait = lease_wait
        self.horizon = horizon
        self.lock = threading.Lock()
        self.leases: dict[tuple[str, str], LocalLease] = {}
        self.keeper: Keeper | None = None  # the LeaseKeeper, set before `start`

    @property
    def _keeper(self) -> Keeper:
        assert self.keeper is not None, "open_leased_ledger sets the keeper"
        return self.keeper

    def start(self) -> None:
        assert self.keeper is not None
        self.keeper.start()

    def close(self) -> None:
        if self.keeper is not None:
            self.keeper.close()

    # -- the request path (event loop) --------------------------------------------------------

    async def prepare(self, identity: Identity, prompt: int, max_tokens: int) -> None:
        """Wait (at most lease_wait) for a top-up when a lease cannot cover the request."""
        leases = self._leases_of(identity)
        need = prompt + max_tokens
        now = time.monotonic()
        with self.lock:
            short = [lease for lease in leases if lease.available(now) < need]
            if not short or self._keeper.failing:
                return
            loop = asyncio.get_running_loop()
            future = loop.create_future()
            for lease in short:
                lease.waiters.append(Waiter(need, prompt + 1, future, loop))
                lease.note_need(need, now)
        self._keeper.poke()
        with contextlib.suppress(TimeoutError):  # then reserve clamps or refuses
            await asyncio.wait_for(asyncio.shield(future), self.lease_wait)

    def reserve(
        self, identity: Identity, request_id: str, prompt: int, max_tokens: int
    ) -> Reservation | None:
        leases = self._leases_of(identity)
        if not leases:
            return None
        now = time.monotonic()
        with self.lock:
            room = min(lease.available(now) for lease in leases)
            if room < prompt + 1:
                raise self._shortfall(leases, prompt, now)
            granted = min(max_tokens, room - prompt)
            reserved = prompt + granted
            for lease in leases:
                lease.open += reserved
                lease.note_reserved(reserved, now)
            low = any(
                lease.available(now) < lease.target(self.horizon, now) // 2 for lease in leases
            )
        if low:
            self._keeper.poke()
        charges = [(lease.subject, lease.period, reserved) for lease in leases]
        return Reservation(request_id, charges, granted, granted < max_tokens, holds=leases)

    async def confirm(self, reservation: Reservation) -> None:
        """Nothing to wait for: the lease it is inside is already durable in PostgreSQL."""

    def settle(self, reservation: Reservation) -> None:
        if reservation.settled:
            return
        reservation.settled = True
        used = min(max(reservation.used, 0), reservation.reserved)
        with self.lock:
            for lease in reservation.holds:
                lease.open -= reservation.reserved
                lease.spent += used

    def _leases_of(self, identity: Identity) -> list[LocalLease]:
        budgets = budgets_of(identity)
        if not budgets:
            return []
        now = time.time()
        leases = []
        with self.lock:
            for subject, budget in budgets:
                key = (subject, period_key(budget.period, now))
                lease = self.leases.get(key)
                if lease is None:
                    tenant = identity.tenant.name
                    lease = self.leases[key] = LocalLease(subject, key[1], budget.tokens, tenant)
                lease.limit = budget.tokens
                leases.append(lease)
        return leases

    def _shortfall(self, leases: list[LocalLease], prompt: int, now: float) -> Exception:
        for lease in leases:
            left = lease.available(now)
            if lease.free is not None and self._keeper.up:
                fleet_left = left + max(lease.free, 0) + lease.held_elsewhere
                if fleet_left < prompt + 1:
                    return BudgetExhausted(
                        f"token budget exhausted: {max(fleet_left, 0)} tokens left across the"
                        f" fleet ({lease.subject}), the prompt alone is {prompt} tokens"
                    )
        return LeaseUnavailable(
            "this replica's share of the token budget cannot cover the request now (the"
            " budget store is unreachable, or other replicas hold the rest): retry shortly,"
            " here or on another replica",
            self._keeper.retry_after(),
        )

    # -- the keeper's side ------------------------------------------------------------------

    def replace(self, old: LocalLease) -> None:
        """`old` expired or was closed: later requests open a fresh lease (under lock)."""
        key = (old.subject, old.period)
        if self.leases.get(key) is old:
            fresh = LocalLease(old.subject, old.period, old.limit, old.tenant, waiters=old.waiters)
            fresh.rate, fresh.rate_at, fresh.peak, fresh.peak_at = (
                old.rate, old.rate_at, old.peak, old.peak_at,
            )  # fmt: skip
            old.waiters = []
            self.leases[key] = fresh
