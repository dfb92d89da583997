"""The usage tables of either store: tokens and refusals per minute, key, tenant and model.

A trusted front's end user (`--trusted-front`, `Call.end_user`) is a dimension of its own
table, `usage_end_user_minutes`: the same counts per minute, key, tenant, model and end user,
written beside (never instead of) `usage_minutes` and only for requests that name one. So the
totals every existing report reads are unchanged, a server without a trusted front writes no
end-user rows at all, and a store file or database from before it only gains a table. A
report by end user (`usage(..., by_end_user=True)`) gives the named end users' rows and, per
key and model, the rest under the end user "" (requests no front named, or past the
recorder's cap): they sum to the totals.

`zerohop.gateway.usage.UsageRecorder` adds each minute's counts (an upsert that adds), so
replicas of a fleet write the same rows of their shared PostgreSQL and a report sums the
fleet. Reports aggregate in SQL (`GROUP BY` the bucket), so a month of one-minute rows is
never read into Python. The SQL is written once with `?` placeholders; PostgreSQL's driver
gets `%s` (`for_postgres`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_TABLES = """
CREATE TABLE IF NOT EXISTS usage_minutes (
    minute {int} NOT NULL, key_id TEXT NOT NULL, tenant TEXT NOT NULL, model TEXT NOT NULL,
    requests {int} NOT NULL DEFAULT 0, errors {int} NOT NULL DEFAULT 0,
    uncached_input_tokens {int} NOT NULL DEFAULT 0,
    cache_read_input_tokens {int} NOT NULL DEFAULT 0,
    output_tokens {int} NOT NULL DEFAULT 0,
    PRIMARY KEY (minute, key_id, tenant, model)
);
CREATE TABLE IF NOT EXISTS refusal_minutes (
    minute {int} NOT NULL, key_id TEXT NOT NULL, tenant TEXT NOT NULL, reason TEXT NOT NULL,
    count {int} NOT NULL DEFAULT 0, last_at {real} NOT NULL, last_message TEXT NOT NULL,
    PRIMARY KEY (minute, key_id, tenant, reason)
);
"""
_END_USER_TABLE = """
CREATE TABLE IF NOT EXISTS usage_end_user_minutes (
    minute {int} NOT NULL, key_id TEXT NOT NULL, tenant TEXT NOT NULL, model TEXT NOT NULL,
    end_user TEXT NOT NULL,
    requests {int} NOT NULL DEFAULT 0, errors {int} NOT NULL DEFAULT 0,
    uncached_input_tokens {int} NOT NULL DEFAULT 0,
    cache_read_input_tokens {int} NOT NULL DEFAULT 0,
    output_tokens {int} NOT NULL DEFAULT 0,
    PRIMARY KEY (minute, key_id, tenant, model, end_user)
);
"""
SQLITE_SCHEMA = (_TABLES + _END_USER_TABLE).format(int="INTEGER", real="REAL")
POSTGRES_SCHEMA = _TABLES.format(int="bigint", real="double precision")  # migration 2
POSTGRES_END_USER_SCHEMA = _END_USER_TABLE.format(int="bigint")  # migration 9

USAGE_COUNTS = ("requests", "errors", "uncached_input_tokens", "cache_read_input_tokens",
                "output_tokens")  # fmt: skip
ADD_USAGE = (
    f"INSERT INTO usage_minutes (minute, key_id, tenant, model, {', '.join(USAGE_COUNTS)})"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (minute, key_id, tenant, model) DO UPDATE"
    f" SET {', '.join(f'{c} = usage_minutes.{c} + excluded.{c}' for c in USAGE_COUNTS)}"
)
ADD_END_USER_USAGE = (
    "INSERT INTO usage_end_user_minutes (minute, key_id, tenant, model, end_user,"
    f" {', '.join(USAGE_COUNTS)}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (minute, key_id, tenant, model, end_user) DO UPDATE SET"
    f" {', '.join(f'{c} = usage_end_user_minutes.{c} + excluded.{c}' for c in USAGE_COUNTS)}"
)
ADD_REFUSALS = (
    "INSERT INTO refusal_minutes (minute, key_id, tenant, reason, count, last_at, last_message)"
    " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (minute, key_id, tenant, reason) DO UPDATE"
    " SET count = refusal_minutes.count + excluded.count,"
    " last_at = CASE WHEN excluded.last_at > refusal_minutes.last_at"
    " THEN excluded.last_at ELSE refusal_minutes.last_at END,"
    " last_message = CASE WHEN excluded.last_at > refusal_minutes.last_at"
    " THEN excluded.last_message ELSE refusal_minutes.last_message END"
)
_SUMS = ", ".join(f"SUM({c}) AS {c}" for c in USAGE_COUNTS)
USAGE_BUCKETS = (
    f"SELECT (minute / ?) * ? AS bucket, key_id, tenant, model, {_SUMS} FROM usage_minutes"
    " WHERE minute >= ? AND minute < ? GROUP BY 1, key_id, tenant, model ORDER BY 1"
)
END_USER_BUCKETS = (
    f"SELECT (minute / ?) * ? AS bucket, key_id, tenant, model, end_user, {_SUMS}"
    " FROM usage_end_user_minutes WHERE minute >= ? AND minute < ?"
    " GROUP BY 1, key_id, tenant, model, end_user ORDER BY 1"
)
REFUSALS = (
    "SELECT reason, key_id, tenant, SUM(count) AS count, MAX(last_at) AS last_at"
    " FROM refusal_minutes WHERE minute >= ? AND minute < ? GROUP BY reason, key_id, tenant"
    " ORDER BY 4 DESC"
)
LAST_MESSAGE = (
    "SELECT last_message FROM refusal_minutes WHERE reason = ? AND key_id = ? AND tenant = ?"
    " AND minute >= ? AND minute < ? ORDER BY last_at DESC LIMIT 1"
)


def for_postgres(sql: str) -> str:
    return sql.replace("?", "%s")


@dataclass(slots=True, frozen=True)
class UsageRow:
    """One (bucket or minute, key, tenant, model[, end user])'s counts."""

    minute: int  # unix seconds at the start of the minute (or bucket)
    key_id: str
    tenant: str
    model: str
    requests: int = 0
    errors: int = 0
    uncached_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    output_tokens: int = 0
    end_user: str = ""  # a trusted front's end user; "" for the totals and the unnamed rest

    def values(self) -> tuple[Any, ...]:
        named = (self.end_user,) if self.end_user else ()
        return (self.minute, self.key_id, self.tenant, self.model, *named,
                *(getattr(self, c) for c in USAGE_COUNTS))  # fmt: skip

    @classmethod
    def of(cls, where: tuple[int, str, str, str], counts: Any, end_user: str = "") -> UsageRow:
        """From (minute, key id, tenant, model) and the USAGE_COUNTS in order."""
        requests, errors, uncached, cache_read, output = counts
        return cls(*where, requests, errors, uncached, cache_read, output, end_user)

    def counts(self) -> tuple[int, ...]:
        return tuple(getattr(self, c) for c in USAGE_COUNTS)


@dataclass(slots=True, frozen=True)
class RefusalRow:
    minute: int
    key_id: str
    tenant: str
    reason: str
    count: int
    last_at: float  # unix seconds
    last_message: str

    def values(self) -> tuple[Any, ...]:
        return (self.minute, self.key_id, self.tenant, self.reason, self.count, self.last_at,
                self.last_message)  # fmt: skip


def usage_row(row: Any, end_user: bool = False) -> UsageRow:
    """A row of USAGE_BUCKETS or END_USER_BUCKETS (a sqlite3.Row or a dict row)."""
    where = (int(row["bucket"]), row["key_id"], row["tenant"], row["model"])
    counts = [int(row[c] or 0) for c in USAGE_COUNTS]
    return UsageRow.of(where, counts, row["end_user"] if end_user else "")


def by_end_user_rows(totals: list[UsageRow], named: list[UsageRow]) -> list[UsageRow]:
    """`named` end users' rows and, per total row, what they leave under the end user ""."""
    left = {_where(row): list(row.counts()) for row in totals}
    for row in named:
        rest = left.get(_where(row))
        if rest is not None:
            rest[:] = [a - b for a, b in zip(rest, row.counts(), strict=True)]
    unnamed = [UsageRow.of(where, counts) for where, counts in left.items() if any(counts)]
    return sorted([*named, *unnamed], key=lambda r: (r.minute, r.key_id, r.model, r.end_user))


def _where(row: UsageRow) -> tuple[int, str, str, str]:
    return row.minute, row.key_id, row.tenant, row.model


class UsageTables:
    """The usage queries over a DB-API connection of either store (`postgres`: %s)."""

    def __init__(self, postgres: bool) -> None:
        sql = for_postgres if postgres else str
        self.add_usage, self.add_refusals = sql(ADD_USAGE), sql(ADD_REFUSALS)
        self.add_end_users = sql(ADD_END_USER_USAGE)
        self.end_user_buckets = sql(END_USER_BUCKETS)
        self.buckets, self.refusals = sql(USAGE_BUCKETS), sql(REFUSALS)
        self.last_message = sql(LAST_MESSAGE)

    def write(self, cursor: Any, usage: list[UsageRow], refusals: list[RefusalRow]) -> None:
        # In key order, so replicas adding into the same rows lock them in the same order.
        totals = sorted(row.values() for row in usage if not row.end_user)
        named = sorted(row.values() for row in usage if row.end_user)
        if totals:
            cursor.executemany(self.add_usage, totals)
        if named:
            cursor.executemany(self.add_end_users, named)
        if refusals:
            cursor.executemany(self.add_refusals, sorted(row.values() for row in refusals))

    def usage(
        self, cursor: Any, width: int, since: int, until: int, by_end_user: bool = False
    ) -> list[UsageRow]:
        """The totals per bucket, key, tenant and model; `by_end_user`: split by end user."""
        params = (width, width, since, until)
        totals = [usage_row(r) for r in cursor.execute(self.buckets, params).fetchall()]
        if not by_end_user:
            return totals
        named = cursor.execute(self.end_user_buckets, params).fetchall()
        return by_end_user_rows(totals, [usage_row(r, end_user=True) for r in named])

    def refusal_totals(self, cursor: Any, since: int, until: int) -> list[RefusalRow]:
        out = []
        for r in cursor.execute(self.refusals, (since, until)).fetchall():
            params = (r["reason"], r["key_id"], r["tenant"], since, until)
            message = cursor.execute(self.last_message, params).fetchone()
            out.append(
                RefusalRow(since, r["key_id"], r["tenant"], r["reason"], int(r["count"]),
                           float(r["last_at"]), message["last_message"] if message else "")
            )  # fmt: skip
        return out
