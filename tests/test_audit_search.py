"""Searching and paging through the audit log (`GET /v1/admin/audit`), on real rotated logs
written by AuditLog: each filter, newest-first order, paging across rotations, content,
torn and garbage lines, and the query parameters' validation."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from zerohop.gateway.audit.log import CURRENT, AuditLog, log_files
from zerohop.gateway.audit.search import AuditPage, AuditQuery, parse_query, search

BASE = 1_700_000_000  # 2023-11-14T22:13:20Z
N = 30
ADMIN = (5, 17, 26)
STATUSES = (200, 429, 400, 500, 201)


def spec(i: int) -> dict:
    """Record i (seq i): request records cycle keys, tenants and statuses; a few are admin."""
    if i in ADMIN:
        actor = "k1" if i == 17 else "adm-1"
        change = {"before": {"rpm": 10}, "after": {"rpm": 20}}
        return {"kind": "admin", "actor": actor, "action": "key.update", "target": "k2",
                "time": BASE + i * 10, **change}  # fmt: skip
    return {
        "request_id": f"req-{i}",
        "key_id": ("k3", "k1", "k2")[i % 3],
        "tenant": "acme" if i % 2 == 0 else "beta",
        "status": STATUSES[i % 5],
        "time": BASE + i * 10,
        "prompt": f"prompt {i}",
        "output": f"output {i}",
    }


def write(directory: Path, start: int = 0, stop: int = N) -> None:
    with AuditLog(directory, max_bytes=1024, flush_interval=0.01, include_content=True) as log:
        for i in range(start, stop):
            log.record(spec(i))


@pytest.fixture
def logdir(tmp_path: Path) -> Path:
    write(tmp_path / "audit")
    assert len(log_files(tmp_path / "audit")) >= 5  # rotated across several files
    return tmp_path / "audit"


def seqs(directory: Path, include_content: bool = False, **query: object) -> list[int]:
    page = search(directory, AuditQuery(**query), include_content)  # type: ignore[arg-type]
    return [rec["seq"] for rec in page.records]


def test_no_filter_newest_first(logdir: Path) -> None:
    page = search(logdir, AuditQuery(), include_content=False)
    assert [r["seq"] for r in page.records] == list(range(N - 1, -1, -1))
    assert (page.has_more, page.next_before) == (False, None)
    assert page.records[0]["request_id"] == "req-29" and page.records[0]["time"].endswith("Z")


def test_key_filter_matches_admin_actor(logdir: Path) -> None:
    assert seqs(logdir, key_id="k1") == [28, 25, 22, 19, 17, 16, 13, 10, 7, 4, 1]
    assert seqs(logdir, key_id="adm-1") == [26, 5]
    assert seqs(logdir, key_id="nobody") == []


def test_tenant_and_kind(logdir: Path) -> None:
    assert seqs(logdir, tenant="beta") == [29, 27, 25, 23, 21, 19, 15, 13, 11, 9, 7, 3, 1]
    assert seqs(logdir, kind="admin") == [26, 17, 5]
    assert seqs(logdir, kind="request") == [i for i in range(N - 1, -1, -1) if i not in ADMIN]
    assert seqs(logdir, kind="admin", key_id="k1") == [17]
    assert seqs(logdir, kind="request", key_id="k1", tenant="acme") == [28, 22, 16, 10, 4]


def test_status_codes_and_classes(logdir: Path) -> None:
    assert seqs(logdir, status="429") == [21, 16, 11, 6, 1]
    assert seqs(logdir, status="4xx") == [27, 22, 21, 16, 12, 11, 7, 6, 2, 1]
    assert seqs(logdir, status="5xx") == [28, 23, 18, 13, 8, 3]
    assert seqs(logdir, status="2xx") == [29, 25, 24, 20, 19, 15, 14, 10, 9, 4, 0]
    assert seqs(logdir, status="201") == [29, 24, 19, 14, 9, 4]
    assert seqs(logdir, status="3xx") == []
    assert seqs(logdir, status="4xx", tenant="acme") == [22, 16, 12, 6, 2]


def test_time_range_is_half_open(logdir: Path) -> None:
    assert seqs(logdir, since=BASE + 100, until=BASE + 150) == [14, 13, 12, 11, 10]
    assert seqs(logdir, since=BASE + 100.000001, until=BASE + 150) == [14, 13, 12, 11]
    assert seqs(logdir, since=BASE + 270) == [29, 28, 27]
    assert seqs(logdir, until=BASE + 30) == [2, 1, 0]
    assert seqs(logdir, since=BASE + 50, until=BASE + 60) == [5]  # an admin record
    assert seqs(logdir, since=BASE + 100, until=BASE + 150, tenant="acme") == [14, 12, 10]
    assert seqs(logdir, since=BASE + 1000) == []


def test_paging_covers_every_record_once(logdir: Path) -> None:
    got, before, pages = [], None, 0
    while True:
        page = search(logdir, AuditQuery(limit=4, before=before), include_content=False)
        pages += 1
        assert pages <= 8
        got += [r["seq"] for r in page.records]
        if not page.has_more:
            assert page.next_before is None
            break
        assert page.next_before == page.records[-1]["seq"] and len(page.records) == 4
        before = page.next_before
    assert got == list(range(N - 1, -1, -1)) and pages == 8


def test_paging_with_a_filter(logdir: Path) -> None:
    first = search(logdir, AuditQuery(key_id="k1", limit=3), include_content=False)
    assert [r["seq"] for r in first.records] == [28, 25, 22]
    assert (first.has_more, first.next_before) == (True, 22)
    assert seqs(logdir, key_id="k1", limit=3, before=22) == [19, 17, 16]
    assert seqs(logdir, key_id="k1", limit=3, before=7) == [4, 1]
    last = search(logdir, AuditQuery(key_id="k1", limit=3, before=7), include_content=False)
    assert (last.has_more, last.next_before) == (False, None)
    assert seqs(logdir, before=0) == []
    assert seqs(logdir, before=1000) == list(range(N - 1, -1, -1))


def test_limit_edges(logdir: Path) -> None:
    exact = search(logdir, AuditQuery(limit=N), include_content=False)
    assert len(exact.records) == N and (exact.has_more, exact.next_before) == (False, None)
    one_short = search(logdir, AuditQuery(limit=N - 1), include_content=False)
    assert [r["seq"] for r in one_short.records] == list(range(N - 1, 0, -1))
    assert (one_short.has_more, one_short.next_before) == (True, 1)
    assert seqs(logdir, limit=1) == [29]
    assert len(seqs(logdir, limit=1000)) == N
    for bad in (0, -1, 1001):
        with pytest.raises(ValueError, match=r"^limit: "):
            AuditQuery(limit=bad)


def test_content_stripped_unless_asked(logdir: Path) -> None:
    plain = search(logdir, AuditQuery(), include_content=False).records
    assert all("prompt" not in r and "output" not in r for r in plain)
    full = search(logdir, AuditQuery(kind="request"), include_content=True).records
    assert [(r["prompt"], r["output"]) for r in full[:2]] == [
        ("prompt 29", "output 29"),
        ("prompt 28", "output 28"),
    ]
    admin = search(logdir, AuditQuery(kind="admin", limit=1), include_content=False).records
    assert admin[0]["before"] == {"rpm": 10} and admin[0]["after"] == {"rpm": 20}


def test_torn_tail_and_garbage_lines_skipped(logdir: Path) -> None:
    oldest = log_files(logdir)[0]
    lines = oldest.read_bytes().split(b"\n")
    oldest.write_bytes(b"\n".join([lines[0], b"not json", b"[1, 2]", *lines[1:]]))
    with (logdir / CURRENT).open("ab") as f:
        f.write(b'{"no": "seq"}\n\xff\xfe\n{"seq": 99, "key_id": "k1"}')  # the last: torn
    assert seqs(logdir) == list(range(N - 1, -1, -1))
    assert seqs(logdir, key_id="k1", limit=2) == [28, 25]


def first_seqs(directory: Path) -> list[int]:
    return [int(p.read_bytes().split(b'"seq":')[1].split(b",")[0]) for p in log_files(directory)]


def test_search_stops_before_older_files(logdir: Path) -> None:
    oldest = log_files(logdir)[0]
    newer = N - first_seqs(logdir)[1]  # records in every file but the oldest
    oldest.unlink()
    oldest.mkdir()  # opening it raises: a search that does not need it must not reach it
    assert seqs(logdir, limit=3) == [29, 28, 27]
    page = search(logdir, AuditQuery(limit=newer - 1), include_content=False)
    assert [r["seq"] for r in page.records] == list(range(N - 1, N - newer, -1))
    assert page.has_more  # the limit+1-th match was the newer files' oldest record
    with pytest.raises(IsADirectoryError):
        search(logdir, AuditQuery(limit=newer), include_content=False)


def test_cursor_at_file_boundaries(logdir: Path) -> None:
    firsts = first_seqs(logdir)
    assert firsts[0] == 0 and firsts == sorted(firsts) and len(set(firsts)) == len(firsts)
    for first in firsts:
        for before in (first, first + 1):
            assert seqs(logdir, limit=3, before=before) == list(range(before - 1, -1, -1))[:3]


def test_a_file_seen_twice_yields_its_records_once(logdir: Path) -> None:
    # What a rotation between reading audit.jsonl and listing the rotated files looks like.
    newest = sorted(p.name for p in log_files(logdir) if p.name != CURRENT)[-1]
    copy = newest.replace(newest.split("-")[1], "99991231T235959.999999Z")
    shutil.copy(logdir / CURRENT, logdir / copy)
    assert seqs(logdir) == list(range(N - 1, -1, -1))


def test_log_written_over_restarts(tmp_path: Path) -> None:
    write(tmp_path, 0, 12)
    write(tmp_path, 12, N)
    assert seqs(tmp_path, status="429") == [21, 16, 11, 6, 1]
    assert seqs(tmp_path, limit=2, before=13) == [12, 11]


def test_missing_or_empty_directory(tmp_path: Path) -> None:
    empty = AuditPage([], False, None)
    assert search(tmp_path / "nope", AuditQuery(), include_content=False) == empty
    assert search(tmp_path, AuditQuery(), include_content=False) == empty
    (tmp_path / CURRENT).write_bytes(b"")
    assert search(tmp_path, AuditQuery(key_id="k1"), include_content=False) == empty
    (tmp_path / CURRENT).write_bytes(b'{"seq": 0, "key_id": "k1"}')  # only a torn line
    assert search(tmp_path, AuditQuery(), include_content=False) == empty


def test_parse_query() -> None:
    params = {
        "api_key_id": "k1",
        "workspace_id": "acme",
        "status": "4XX",
        "kind": "admin",
        "starting_at": "2023-11-14T22:13:20Z",
        "ending_at": "1700000100.5",
        "limit": "10",
        "before": "7",
    }
    want = AuditQuery("k1", "acme", "4xx", "admin", BASE, BASE + 100.5, 10, 7)
    assert parse_query(params) == want
    assert parse_query({"starting_at": "2023-11-15T00:13:20.25+02:00"}).since == BASE + 0.25
    assert parse_query({"ending_at": "1700000000"}).until == BASE
    assert parse_query({}) == AuditQuery()
    assert parse_query(dict.fromkeys(params, "")) == AuditQuery()


def test_parse_query_into_search(logdir: Path) -> None:
    query = parse_query({"starting_at": "2023-11-14T22:15:00Z", "ending_at": str(BASE + 150)})
    assert [r["seq"] for r in search(logdir, query, include_content=False).records] == [
        14, 13, 12, 11, 10,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("status", "42"),
        ("status", "4x"),
        ("status", "600"),
        ("status", "abc"),
        ("kind", "user"),
        ("limit", "0"),
        ("limit", "1001"),
        ("limit", "ten"),
        ("limit", "-1"),
        ("before", "-1"),
        ("before", "x"),
        ("starting_at", "yesterday"),
        ("starting_at", "2023-11-14T22:13:20"),  # no Z or offset
        ("starting_at", "2023-11-14"),
        ("ending_at", "nan"),
        ("ending_at", "inf"),
        ("ending_at", "-5"),
        ("api_key", "k1"),  # unknown
    ],
)
def test_parse_query_errors_name_the_parameter(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"^{name}: "):
        parse_query({name: value})


def test_query_validation_names_the_field() -> None:
    for field, value in [
        ("status", "4XX"),
        ("status", "429 "),
        ("kind", "Admin"),
        ("since", float("nan")),
        ("until", float("inf")),
        ("before", -1),
        ("limit", 2.5),
    ]:
        with pytest.raises(ValueError, match=f"^{field}: "):
            AuditQuery(**{field: value})  # type: ignore[arg-type]
