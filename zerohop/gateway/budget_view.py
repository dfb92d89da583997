"""A key's token budgets as a client sees them: how much of each is spent and when its
period starts over (the unified rate-limit headers, a spent budget's retry-after).

Spend is the replica's SQLite ledger's (reservations of requests in flight included); a
fleet's leased ledger holds only this replica's slices, so there `spent` is None and only
the reset is known.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime

from zerohop.gateway.budgets.ledger import Ledger
from zerohop.gateway.budgets.sqlite_ledger import BudgetLedger, budgets_of, period_key
from zerohop.gateway.keys.identity import Identity


@dataclass(slots=True, frozen=True)
class BudgetReading:
    subject: str  # "key:<id>" | "tenant:<name>"
    tokens: int  # the budget per period
    spent: int | None  # None: not known here (a fleet replica)
    resets_at: float | None  # unix seconds; None: a total budget never starts over

    @property
    def utilization(self) -> float | None:
        if self.spent is None:
            return None
        return 1.0 if self.tokens <= 0 else min(1.0, self.spent / self.tokens)

    def room(self) -> int | None:
        return None if self.spent is None else self.tokens - self.spent


def period_end(period: str, now: float) -> float | None:
    """When the budget period holding `now` ends (UTC days and months, as the ledger keys
    them); None for "total"."""
    moment = datetime.fromtimestamp(now, UTC)
    day = moment.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return day.timestamp() + 86400
    if period == "month":
        first = day.replace(day=1)
        year, month = (first.year + 1, 1) if first.month == 12 else (first.year, first.month + 1)
        return first.replace(year=year, month=month).timestamp()
    return None


def readings(
    identity: Identity, ledger: Ledger | None, now: float | None = None
) -> list[BudgetReading]:
    """The key's and its tenant's budgets, with what is spent of them this period."""
    now = time.time() if now is None else now
    spent = ledger.spent if isinstance(ledger, BudgetLedger) else None
    out = []
    for subject, budget in budgets_of(identity):
        used = None if spent is None else spent.get((subject, period_key(budget.period, now)), 0)
        out.append(BudgetReading(subject, budget.tokens, used, period_end(budget.period, now)))
    return out


def refusal_retry_after(
    identity: Identity, ledger: Ledger | None, prompt: int, now: float | None = None
) -> float | None:
    """Seconds until every budget too spent for `prompt` starts over; None where one of them
    never does (a total budget), or none is known to be spent."""
    now = time.time() if now is None else now
    # A fleet replica knows no spend: then every budget may be the spent one.
    spent = [r for r in readings(identity, ledger, now) if _short(r.room(), prompt)]
    if not spent or any(r.resets_at is None for r in spent):
        return None
    return max(r.resets_at for r in spent if r.resets_at is not None) - now


def _short(room: int | None, prompt: int) -> bool:
    return room is None or room < prompt + 1
