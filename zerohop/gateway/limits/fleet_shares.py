"""Per-minute rate limits across a fleet: each replica holds a share of each limit.

For every limited key and tenant a replica serves, PostgreSQL holds its share w (its
`rate_shares` row) and the sum of the live shares stays <= 1, under the `rate_subjects`
row's lock. A replica's buckets hold w times the limit and refill at w times its rate
(`limits.set_share`). At every heartbeat each replica reports its demand (what it was
asked for lately, in parts of the limit: refused requests count, so a starved replica asks
for more) and takes the share that demand earns it, out of what the others leave free
(`zerohop.gateway.store.rate_share_tables`, through the store's lease repository):
shares follow use within a couple of heartbeats, and a replica that stops asking gives its
share back after IDLE seconds.

Accuracy: capacity a replica gains starts empty, so the fleet's buckets together never
hold more than one limit's worth, and in any interval T the fleet admits at most L + L·T/60
requests (or input tokens): the bound of one replica with the whole limit. What can go
past it: a share taken back is applied here one round trip after PostgreSQL frees it; a
replica cut off from PostgreSQL keeps serving at min(its share, 1/N) while the others may
grow into its expired row; output tokens are charged as they are produced, as on one
replica. `max_concurrency` stays per replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Protocol

from zerohop.gateway.keys.identity import Identity
from zerohop.gateway.limits import buckets as limits
from zerohop.gateway.limits.buckets import RateLimiter, SubjectLimits
from zerohop.gateway.store.lease_repository import LeaseRepository

IDLE = 60.0  # seconds without a request: the share goes back
DEMAND_HALF_LIFE = 5.0  # seconds
FORGET_AFTER = 60.0  # seconds an expired row is kept: the fleet's bucket was not idle


@dataclass(slots=True)
class Demand:
    asked: float = 0.0  # SubjectLimits.asked at the last heartbeat
    rate: float = 0.0  # parts of the limit asked per minute, decaying average
    at: float = 0.0


class Heartbeat(Protocol):
    """The thread whose heartbeat runs `FleetRates.beat` (the lease keeper), as asked to
    beat sooner."""

    @property
    def failing(self) -> bool: ...

    def poke(self) -> None: ...


class FleetRates:
    """This replica's shares: renewed by the lease keeper's heartbeat (its thread), applied
    on the event loop."""

    def __init__(self, limiter: RateLimiter, wait: float, keeper: Heartbeat | None = None) -> None:
        limiter.fleet = True
        self.limiter = limiter
        self.wait = wait
        self.loop: asyncio.AbstractEventLoop | None = None
        self.keeper = keeper  # the LeaseKeeper whose heartbeat runs `beat`
        self.replicas = 1  # live replicas at the last heartbeat
        self._demand: dict[str, Demand] = {}
        self._granted: dict[str, float] = {}  # subject -> share PostgreSQL last gave
        self._waiting: dict[str, asyncio.Event] = {}

    def shares(self) -> dict[str, float]:
        """subject -> the share PostgreSQL last granted this replica."""
        return dict(self._granted)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    async def prepare(self, identity: Identity) -> None:
        """Before a subject's first request here, wait (at most `wait`) for its share."""
        missing = [name for name, state in self.limiter.peek(identity) if name not in self._granted]
        if not missing or self.keeper is None or self.keeper.failing:
            return
        events = [self._waiting.setdefault(name, asyncio.Event()) for name in missing]
        self.keeper.poke()
        with contextlib.suppress(TimeoutError):  # then the limiter refuses, retryable
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), self.wait)

    # -- the keeper's thread -------------------------------------------------------------------

    def waiting(self) -> bool:
        """A request waits for a share this replica does not hold yet."""
        return bool(self._waiting)

    def beat(
        self,
        leases: LeaseRepository,
        replica_id: str,
        ttl: float,
        now: float,
        only_waiting: bool = False,
    ) -> None:
        subjects = dict(self.limiter.subjects())  # a copy: the loop may add meanwhile
        for name, state in subjects.items():
            if only_waiting and name not in self._waiting:
                continue
            idle = now - state.asked_at > IDLE
            if idle and name in self._granted:
                leases.give_back_share(replica_id, name)
                self._post(name, 0.0, False, forget=True)
            elif not idle or name in self._waiting:
                demand = self._rate(name, state, now)
                share, fresh = leases.rebalance(replica_id, name, demand, ttl)
                self._post(name, share, fresh and name not in self._granted)

    def fall_back(self) -> None:
        """Cut off from PostgreSQL past the shares' deadline: others may take our rows."""
        floor = 1.0 / max(1, self.replicas)
        for name, share in list(self._granted.items()):
            if share > floor:
                self._post(name, floor, False)

    def _rate(self, name: str, state: SubjectLimits, now: float) -> float:
        d = self._demand.setdefault(name, Demand(state.asked, 0.0, now))
        elapsed = max(now - d.at, 1e-3)
        decay = 0.5 ** (elapsed / DEMAND_HALF_LIFE)
        d.rate = d.rate * decay + (1 - decay) * (state.asked - d.asked) * 60.0 / elapsed
        d.asked, d.at = state.asked, now
        return max(d.rate, 1e-6)  # asked lately: worth a share, if only the floor

    def _post(self, name: str, share: float, fresh: bool, forget: bool = False) -> None:
        if forget:
            self._granted.pop(name, None)
            self._demand.pop(name, None)
        else:
            self._granted[name] = share
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._apply, name, share, fresh)

    def _apply(self, name: str, share: float, fresh: bool) -> None:
        state = self.limiter.subjects().get(name)
        if state is not None:
            limits.set_share(state, share, time.monotonic(), fill=fresh)
        if (event := self._waiting.pop(name, None)) is not None:
            event.set()
