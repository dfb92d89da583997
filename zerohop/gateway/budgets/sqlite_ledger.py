"""Token budgets that are never exceeded and never under-counted, not even across a crash.

A budget is a number of tokens (uncached input + output) per UTC day, per UTC month, or in
total, for a key and for its tenant. Admission reserves prompt + max_tokens (max_tokens
clamped to what remains) against every budget that applies, in memory at once, and durably
before the request reaches the engine (`confirm`): the writer thread of
`zerohop.gateway.budgets.sqlite_writer` group-commits the reservations of concurrent admissions, and
each request awaits its own commit without blocking the event loop. The ledger row already
counts the whole reservation; when the request ends the unused part is given back, once per
request id. So a crash between the two leaves the reservation counted in full: spend can be
over-counted by a crash, never under-counted. A reservation that could not be written
(a disk error) is taken back and its request refused: nothing is refunded for it.

What a crash cannot lose depends on `durability`: `normal` survives a killed process (kill
-9, the OOM killer); `full` also survives an OS crash or power loss, at one fsync per group
commit.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from zerohop.gateway.budgets.sqlite_writer import (
    Charge,
    Durability,
    LedgerUnavailable,
    LedgerWriter,
    ReserveOp,
    SettleOp,
)
from zerohop.gateway.keys.identity import Budget, Identity
from zerohop.gateway.store.repositories import LedgerRepository

__all__ = ["BudgetExhausted", "BudgetLedger", "Charge", "LedgerUnavailable", "Reservation"]


class LeaseHold(Protocol):
    """A slice of a fleet budget a reservation is inside: what settling it changes."""

    spent: int  # final use of settled reservations
    open: int  # reserved by requests in flight


class BudgetExhausted(Exception):
    """Not even the prompt plus one output token fits in what remains."""


def period_key(period: str, now: float | None = None) -> str:
    moment = datetime.fromtimestamp(time.time() if now is None else now, UTC)
    if period == "day":
        return "day:" + moment.strftime("%Y-%m-%d")
    if period == "month":
        return "month:" + moment.strftime("%Y-%m")
    return "total"


@dataclass(slots=True)
class Reservation:
    request_id: str
    charges: list[Charge]  # what was reserved, per (subject, period)
    max_tokens: int  # granted (clamped) max_tokens
    clamped: bool
    durable: asyncio.Future[None] | None = None
    used: int = 0  # tokens spent so far (uncached input + output), settled per step
    settled: bool = False  # given back (or taken back): nothing more to do
    # The fleet's leases it is inside (leased_ledger's LocalLease; none with a local ledger).
    holds: Sequence[LeaseHold] = field(default_factory=list)

    @property
    def reserved(self) -> int:
        return self.charges[0][2] if self.charges else 0


class BudgetLedger:
    """In-memory spend per (subject, period), kept durable by a group-committing writer."""

    def __init__(self, ledger: LedgerRepository, durability: Durability = "full") -> None:
        """`ledger`: the store's, whose SQLite file the writer opens on `start`."""
        self.spent: dict[tuple[str, str], int] = defaultdict(int)
        self.writer = LedgerWriter(ledger, durability)
        self._open: dict[str, Reservation] = {}  # request id -> its (first) reservation

    @property
    def durability(self) -> Durability:
        return self.writer.durability

    @property
    def failing(self) -> bool:
        """The last write failed: budgeted requests are being refused."""
        return self.writer.failing

    @property
    def commits(self) -> int:
        return self.writer.commits

    def start(self) -> None:
        self.spent.update(self.writer.start())

    def close(self) -> None:
        self.writer.close()

    # -- the request path (event loop) ----------------------------------------------------

    async def prepare(self, identity: Identity, prompt: int, max_tokens: int) -> None:
        """Nothing to wait for here: one replica's budgets are all its own (a fleet's
        ledger waits for a lease top-up, `zerohop.gateway.budgets.leased_ledger`)."""

    def reserve(
        self, identity: Identity, request_id: str, prompt: int, max_tokens: int
    ) -> Reservation | None:
        """Reserve prompt + max_tokens (clamped) on every budget of the key and its tenant;
        None when neither has a budget. `confirm` it before the request reaches the engine."""
        budgets = budgets_of(identity)
        if not budgets:
            return None
        now = time.time()
        keys = [(subject, period_key(budget.period, now)) for subject, budget in budgets]
        room = min(b.tokens - self.spent[k] for (_, b), k in zip(budgets, keys, strict=True))
        if room < prompt + 1:
            raise BudgetExhausted(
                f"token budget exhausted: {max(room, 0)} tokens left, the prompt alone is"
                f" {prompt} tokens"
            )
        granted = min(max_tokens, room - prompt)
        reserved = prompt + granted
        charges = [(subject, period, reserved) for subject, period in keys]
        for key in keys:
            self.spent[key] += reserved
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self.writer.submit(ReserveOp(request_id, charges, done, loop))
        reservation = Reservation(request_id, charges, granted, granted < max_tokens, done)
        self._open.setdefault(request_id, reservation)
        return reservation

    async def confirm(self, reservation: Reservation) -> None:
        """Wait until the reservation is durable. When it cannot be written, it is taken back
        (nothing to refund later) and `LedgerUnavailable` is raised: refuse the request."""
        assert reservation.durable is not None, "confirm a reservation made by reserve()"
        try:
            await reservation.durable
        except LedgerUnavailable:
            self._take_back(reservation)
            raise

    def settle(self, reservation: Reservation) -> None:
        """Give back what the request did not use, once; durable soon after, awaited by
        nobody (the writer refunds a request id only if its reservation is durable)."""
        if not self._close(reservation):
            return
        unused = max(0, reservation.reserved - reservation.used)
        for subject, period, _ in reservation.charges:
            self.spent[(subject, period)] -= unused
        used = reservation.reserved - unused
        self.writer.submit(SettleOp(reservation.request_id, reservation.charges, used))

    def _take_back(self, reservation: Reservation) -> None:
        if self._close(reservation):
            for subject, period, tokens in reservation.charges:
                self.spent[(subject, period)] -= tokens

    def _close(self, reservation: Reservation) -> bool:
        """Mark it settled; False when it was already, or is not its request id's own (the
        writer would refund nothing for it either)."""
        if reservation.settled:
            return False
        reservation.settled = True
        if self._open.get(reservation.request_id) is not reservation:
            return False
        del self._open[reservation.request_id]
        return True


def budgets_of(identity: Identity) -> list[tuple[str, Budget]]:
    pairs = []
    if identity.budget is not None:
        pairs.append((f"key:{identity.key_id}", identity.budget))
    if identity.tenant.budget is not None:
        pairs.append((f"tenant:{identity.tenant.name}", identity.tenant.budget))
    return pairs
