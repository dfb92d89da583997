"""The seams of a token-budget ledger, as the gateway and the lease keeper use them.

`Ledger` is what `Gateway` calls on whichever ledger it has: the SQLite `BudgetLedger`
(sqlite_ledger.py, one replica) or the fleet's `LeasedLedger` (leased_ledger.py). `Keeper`
is what the leased ledger asks of the thread that keeps its leases (lease_keeper.py), and
what a fleet's rate shares ask of it too (limits/fleet_shares.py).
"""

from __future__ import annotations

from typing import Protocol

from zerohop.gateway.budgets.sqlite_ledger import Reservation
from zerohop.gateway.keys.identity import Identity
from zerohop.gateway.store.lease_repository import LeaseRepository


class Ledger(Protocol):
    @property
    def durability(self) -> str: ...

    @property
    def failing(self) -> bool: ...

    @property
    def commits(self) -> int: ...

    def start(self) -> None: ...

    def close(self) -> None: ...

    async def prepare(self, identity: Identity, prompt: int, max_tokens: int) -> None: ...

    def reserve(
        self, identity: Identity, request_id: str, prompt: int, max_tokens: int
    ) -> Reservation | None: ...

    async def confirm(self, reservation: Reservation) -> None: ...

    def settle(self, reservation: Reservation) -> None: ...


class Keeper(Protocol):
    """The lease keeper as its ledger and the rate shares see it."""

    @property
    def up(self) -> bool: ...

    @property
    def failing(self) -> bool: ...

    def poke(self) -> None: ...

    def retry_after(self) -> float: ...

    def start(self) -> None: ...

    def close(self) -> None: ...


class RateShares(Protocol):
    """A fleet's rate-limit shares (limits/fleet_shares.py), renewed with the keeper's
    heartbeat through the keeper's lease repository."""

    replicas: int

    def beat(
        self,
        leases: LeaseRepository,
        replica_id: str,
        ttl: float,
        now: float,
        only_waiting: bool = False,
    ) -> None: ...

    def waiting(self) -> bool: ...

    def fall_back(self) -> None: ...
