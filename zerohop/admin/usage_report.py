"""Anthropic's messages usage report (`GET /v1/organizations/usage_report/messages`) over
the store's per-minute usage rows, and the refusals report beside it.

Buckets are snapped to the UTC minute, hour or day, as Anthropic's are; `limit` counts
buckets, `page` is the next bucket's start. A field not grouped by is null. Rows are
summed in SQL per bucket, key, tenant and model (`usage_sql.USAGE_BUCKETS`), then collapsed
here to the dimensions asked for.

zerohop's own dimension: `group_by[]=end_user` and the filter `end_users[]` (a trusted
front's end user, `--trusted-front`) read the rows split by end user, each result naming it
in `zerohop.end_user`; requests no front named are the end user "", so the results of a key
sum to its total. Without either, the report reads the totals alone, as before.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zerohop.admin.wire import parse_time, rfc3339
from zerohop.gateway.store.usage_tables import USAGE_COUNTS, RefusalRow, UsageRow

WIDTHS = {"1m": 60, "1h": 3600, "1d": 86400}
LIMITS = {"1m": (60, 1440), "1h": (24, 168), "1d": (7, 31)}  # (default, max) buckets
GROUPS = {"api_key_id": "key_id", "workspace_id": "tenant", "model": "model",
          "end_user": "end_user"}  # fmt: skip
Query = Mapping[str, Sequence[str]]


@dataclass(slots=True, frozen=True)
class UsageQuery:
    width: int
    since: int  # the first bucket's start
    until: int  # past the last bucket's end
    group_by: tuple[str, ...]  # API names: api_key_id, workspace_id, model, end_user
    key_ids: frozenset[str]
    tenants: frozenset[str]
    models: frozenset[str]
    more: bool  # buckets after `until` hold usage to come or kept: has_more
    end_users: frozenset[str] = frozenset()

    @property
    def by_end_user(self) -> bool:
        """Whether the rows must be split by end user."""
        return "end_user" in self.group_by or bool(self.end_users)


def parse_usage_query(query: Query, now: float | None = None) -> UsageQuery:
    """ValueError names the parameter that is wrong."""
    width_name = one(query, "bucket_width") or "1d"
    if width_name not in WIDTHS:
        raise ValueError(f"bucket_width must be one of 1m, 1h, 1d, not {width_name!r}")
    width = WIDTHS[width_name]
    default, most = LIMITS[width_name]
    limit_text = one(query, "limit")
    limit = default if limit_text is None else integer(limit_text, "limit")
    if not 1 <= limit <= most:
        raise ValueError(f"limit must be 1-{most} for bucket_width {width_name}, not {limit}")
    start_text = one(query, "page") or one(query, "starting_at")
    if start_text is None:
        raise ValueError("starting_at is required (an RFC 3339 time)")
    since = int(parse_time(start_text, "starting_at") // width * width)
    limit_end = since + limit * width
    end = one(query, "ending_at")
    ending = parse_time(end, "ending_at") if end is not None else float("inf")
    if ending <= parse_time(start_text, "starting_at"):
        raise ValueError("ending_at must be after starting_at")
    now = time.time() if now is None else now
    current_end = (int(now) // width + 1) * width  # no bucket after the one under way
    until = int(min(limit_end, ending, current_end))
    more = until == limit_end and ending > until and until < now
    groups = tuple(many(query, "group_by"))
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        raise ValueError(f"group_by: {bad[0]!r} is not one of {', '.join(GROUPS)}")
    return UsageQuery(
        width, since, max(until, since), groups, frozenset(many(query, "api_key_ids")),
        frozenset(many(query, "workspace_ids")), frozenset(many(query, "models")), more,
        frozenset(many(query, "end_users")),
    )  # fmt: skip


def usage_report(q: UsageQuery, rows: list[UsageRow]) -> dict[str, Any]:
    """The report's JSON."""
    buckets: dict[int, dict[tuple[str, ...], list[int]]] = {}
    for row in rows:
        if not _wanted(q, row):
            continue
        group = tuple(getattr(row, GROUPS[g]) for g in q.group_by)
        counts = buckets.setdefault(row.minute, {}).setdefault(group, [0] * len(USAGE_COUNTS))
        counts[:] = [a + getattr(row, c) for a, c in zip(counts, USAGE_COUNTS, strict=True)]
    data = []
    for start in range(q.since, q.until, q.width):
        groups = buckets.get(start, {})
        results = [_result(q, group, counts) for group, counts in sorted(groups.items())]
        data.append({"starting_at": rfc3339(start), "ending_at": rfc3339(start + q.width),
                     "results": results})  # fmt: skip
    next_page = rfc3339(q.until) if q.more else None
    return {"data": data, "has_more": q.more, "next_page": next_page}


def _wanted(q: UsageQuery, row: UsageRow) -> bool:
    return (
        (not q.key_ids or row.key_id in q.key_ids)
        and (not q.tenants or row.tenant in q.tenants)
        and (not q.models or row.model in q.models)
        and (not q.end_users or row.end_user in q.end_users)
    )


def _result(q: UsageQuery, group: tuple[str, ...], counts: list[int]) -> dict[str, Any]:
    values = dict(zip(USAGE_COUNTS, counts, strict=True))
    named = dict(zip(q.group_by, group, strict=True))
    return {
        "uncached_input_tokens": values["uncached_input_tokens"],
        "cache_read_input_tokens": values["cache_read_input_tokens"],
        "cache_creation": {"ephemeral_1h_input_tokens": 0, "ephemeral_5m_input_tokens": 0},
        "output_tokens": values["output_tokens"],
        "server_tool_use": {"web_search_requests": 0},
        "api_key_id": named.get("api_key_id"),
        "workspace_id": named.get("workspace_id"),
        "model": named.get("model"),
        "service_tier": "standard",
        "context_window": None,
        "zerohop": {
            "requests": values["requests"],
            "errors": values["errors"],
            "end_user": named.get("end_user"),
        },
    }


def refusals_report(rows: list[RefusalRow]) -> dict[str, Any]:
    return {
        "data": [
            {"reason": r.reason, "api_key_id": r.key_id, "workspace_id": r.tenant,
             "count": r.count, "last_at": rfc3339(r.last_at), "last_message": r.last_message}
            for r in rows
        ]
    }  # fmt: skip


def time_range(query: Query, default_seconds: float, now: float | None = None) -> tuple[int, int]:
    """(since, until) in unix seconds from starting_at/ending_at (default: the last ...)."""
    now = time.time() if now is None else now
    end = one(query, "ending_at")
    until = parse_time(end, "ending_at") if end is not None else now + 60
    start = one(query, "starting_at")
    since = parse_time(start, "starting_at") if start is not None else now - default_seconds
    if until <= since:
        raise ValueError("ending_at must be after starting_at")
    return int(since // 60 * 60), int(until)


def one(query: Query, name: str) -> str | None:
    values = query.get(name)
    if not values:
        return None
    if len(values) > 1:
        raise ValueError(f"{name} was given {len(values)} times: give it once")
    return values[0]


def many(query: Query, name: str) -> list[str]:
    """A list parameter, as `name[]=a&name[]=b` (the SDKs), `name=a&name=b` or `name=a,b`."""
    values = [*query.get(name, ()), *query.get(name + "[]", ())]
    return [part for value in values for part in value.split(",") if part]


def integer(text: str, name: str) -> int:
    """An integer parameter (at most 18 digits: what a store column holds)."""
    if len(text) > 18 or not text.strip().lstrip("-").isdigit():
        raise ValueError(f"{name} must be an integer, not {text[:40]!r}")
    return int(text)
