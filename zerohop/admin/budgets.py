"""`GET /v1/admin/budgets`: every key's and tenant's budget, what its current period used,
and when it runs out at the rate of the last hour.

Use comes from the budget ledger this replica charges (one replica's SQLite) or the fleet's
store (PostgreSQL: settled plus leased, so slices granted to replicas count as used until
they are reported back). The rate is the last hour's uncached input and output tokens from
the usage report rows.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from zerohop.admin.wire import rfc3339
from zerohop.gateway.budgets.sqlite_ledger import period_key
from zerohop.gateway.keys.identity import Budget
from zerohop.gateway.store.usage_tables import UsageRow

HOUR = 3600
HORIZON = 10 * 365 * 86400  # a budget in total lasting longer "does not run out"


def period_end(period: str, now: float) -> float | None:
    """When the current day or month period ends (UTC); None for a total budget."""
    moment = datetime.fromtimestamp(now, UTC)
    if period == "day":
        start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
        return start.timestamp() + 86400
    if period == "month":
        after = moment.year * 12 + moment.month  # the next month, counted from year 0
        return datetime(after // 12, after % 12 + 1, 1, tzinfo=UTC).timestamp()
    return None


def budgets_report(
    budgets: list[tuple[str, str, Budget]],  # (kind, name, budget)
    spent: dict[tuple[str, str], int],  # (subject, period key) -> tokens
    last_hour: list[UsageRow],
    now: float | None = None,
) -> dict[str, Any]:
    now = time.time() if now is None else now
    burn: dict[str, int] = {}
    for row in last_hour:
        tokens = row.uncached_input_tokens + row.output_tokens
        for subject in (f"key:{row.key_id}", f"tenant:{row.tenant}"):
            burn[subject] = burn.get(subject, 0) + tokens
    data = []
    for kind, name, budget in budgets:
        subject = f"{kind}:{name}"
        used = spent.get((subject, period_key(budget.period, now)), 0)
        remaining = max(budget.tokens - used, 0)
        ends = period_end(budget.period, now)
        per_hour = burn.get(subject, 0)
        runs_out = now + remaining / per_hour * HOUR if per_hour else None
        if runs_out is not None and runs_out >= (ends or now + HORIZON):
            runs_out = None  # lasts the period (or, in total, the next ten years) at this rate
        data.append(
            {"subject": subject, "kind": kind, "name": name, "period": budget.period,
             "tokens": budget.tokens, "used": used, "remaining": remaining,
             "period_ends_at": rfc3339(ends), "burn_per_hour": per_hour,
             "runs_out_at": rfc3339(runs_out)}
        )  # fmt: skip
    return {"data": data}
