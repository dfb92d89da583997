"""zerohop.admin.usage_report: Anthropic's messages usage report over per-minute rows:
buckets snapped to UTC, limits per bucket width, paging, grouping and filters."""

from __future__ import annotations

import pytest

from zerohop.admin.usage_report import parse_usage_query, usage_report
from zerohop.gateway.store.usage_tables import UsageRow

DAY = 86400
MIDNIGHT = 1_764_633_600  # 2025-12-02T00:00:00Z
NOW = MIDNIGHT + 10 * DAY + 3600  # ten days later, 01:00


def query(**params: str | list[str]):
    return parse_usage_query(
        {k: v if isinstance(v, list) else [v] for k, v in params.items()}, now=NOW
    )


def rows() -> list[UsageRow]:
    return [
        UsageRow(MIDNIGHT, "zh-a", "t1", "m1", 1, 0, 10, 1, 5),
        UsageRow(MIDNIGHT, "zh-b", "t1", "m2", 1, 0, 20, 2, 6),
        UsageRow(MIDNIGHT, "zh-c", "t2", "m1", 1, 1, 30, 3, 7),
        UsageRow(MIDNIGHT + 2 * DAY, "zh-a", "t1", "m1", 2, 0, 40, 4, 8),
    ]


def test_days_snap_to_utc_and_pages_follow_the_limit() -> None:
    q = query(starting_at="2025-12-02T13:45:00Z", limit="2")
    assert (q.since, q.until, q.width) == (MIDNIGHT, MIDNIGHT + 2 * DAY, DAY)
    report = usage_report(q, rows())
    assert [b["starting_at"] for b in report["data"]] == [
        "2025-12-02T00:00:00Z", "2025-12-03T00:00:00Z"]  # fmt: skip
    assert report["has_more"] and report["next_page"] == "2025-12-04T00:00:00Z"
    (total,) = report["data"][0]["results"]  # nothing grouped: one row, every field null
    assert (total["uncached_input_tokens"], total["cache_read_input_tokens"],
            total["output_tokens"]) == (60, 6, 18)  # fmt: skip
    assert total["api_key_id"] is None and total["model"] is None
    assert report["data"][1]["results"] == []
    second = usage_report(query(starting_at="2025-12-02T00:00:00Z", page=report["next_page"],
                                limit="2"), rows())  # fmt: skip
    assert second["data"][0]["results"][0]["output_tokens"] == 8


def test_no_bucket_after_the_current_one_and_ending_at_stops_early() -> None:
    q = query(starting_at=str(MIDNIGHT), limit="31")
    assert q.until == MIDNIGHT + 11 * DAY and not q.more  # today's bucket is the last
    q = query(starting_at=str(MIDNIGHT), ending_at=str(MIDNIGHT + DAY), limit="5")
    assert q.until == MIDNIGHT + DAY and not q.more


def test_grouping_and_filters() -> None:
    q = query(starting_at=str(MIDNIGHT), limit="1", **{"group_by[]": ["workspace_id", "model"]})
    results = usage_report(q, rows())["data"][0]["results"]
    assert [(r["workspace_id"], r["model"], r["output_tokens"]) for r in results] == [
        ("t1", "m1", 5), ("t1", "m2", 6), ("t2", "m1", 7)]  # fmt: skip
    assert all(r["api_key_id"] is None for r in results)
    q = query(starting_at=str(MIDNIGHT), limit="1", group_by="api_key_id",
              api_key_ids="zh-a,zh-c", models=["m1"])  # fmt: skip
    results = usage_report(q, rows())["data"][0]["results"]
    assert [(r["api_key_id"], r["zerohop"]["errors"]) for r in results] == [
        ("zh-a", 0), ("zh-c", 1)]  # fmt: skip


@pytest.mark.parametrize(
    "params, message",
    [
        ({}, "starting_at is required"),
        ({"starting_at": "yesterday"}, "starting_at"),
        ({"starting_at": str(MIDNIGHT), "bucket_width": "1w"}, "bucket_width"),
        ({"starting_at": str(MIDNIGHT), "limit": "32"}, "limit must be 1-31"),
        ({"starting_at": str(MIDNIGHT), "bucket_width": "1m", "limit": "1441"}, "1-1440"),
        ({"starting_at": str(MIDNIGHT), "limit": "many"}, "limit must be an integer"),
        ({"starting_at": str(MIDNIGHT), "group_by": "region"}, "group_by"),
        ({"starting_at": [str(MIDNIGHT), str(MIDNIGHT)]}, "given 2 times"),
        ({"starting_at": "nan"}, "starting_at"),
    ],
)
def test_bad_parameters_name_themselves(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        query(**params)


def test_budgets_report_what_remains_and_when_it_runs_out() -> None:
    from zerohop.admin.budgets import budgets_report
    from zerohop.gateway.budgets.sqlite_ledger import period_key
    from zerohop.gateway.keys.identity import Budget

    budgets = [("key", "zh-a", Budget(1000, "day")), ("tenant", "t1", Budget(10**6, "month")),
               ("tenant", "t2", Budget(500)), ("key", "zh-c", Budget(10**9, "day"))]  # fmt: skip
    spent = {("key:zh-a", period_key("day", NOW)): 400, ("key:zh-a", "day:2020-01-01"): 999}
    last_hour = [UsageRow(NOW - 600, "zh-a", "t1", "m", 1, 0, 150, 50, 50),
                 UsageRow(NOW - 60, "zh-c", "t2", "m", 1, 0, 100, 0, 0)]  # fmt: skip
    rows = {r["subject"]: r for r in budgets_report(budgets, spent, last_hour, NOW)["data"]}
    key = rows["key:zh-a"]
    assert (key["used"], key["remaining"], key["burn_per_hour"]) == (400, 600, 200)
    assert key["runs_out_at"] == "2025-12-12T04:00:00Z"  # 600 left at 200 an hour, from 01:00
    assert key["period_ends_at"] == "2025-12-13T00:00:00Z"
    month = rows["tenant:t1"]
    assert month["burn_per_hour"] == 200 and month["runs_out_at"] is None  # lasts the month
    assert month["period_ends_at"] == "2026-01-01T00:00:00Z"
    total = rows["tenant:t2"]  # a budget in total: no period end, runs out in 5 hours
    assert total["period_ends_at"] is None and total["runs_out_at"] == "2025-12-12T06:00:00Z"
    assert rows["key:zh-c"]["runs_out_at"] is None  # past the day's end at this rate
