"""Searching and paging through the audit log, newest first (`GET /v1/admin/audit`).

`search` reads the log's files newest first (`audit.jsonl`, then the rotated files newest to
oldest), each file's lines from its end, and stops once it holds `limit + 1` matches: the
first page of a busy log reads only the newest file or two. Its cost is reading and parsing
each file it reaches whole (files are at most `max_bytes`, 64 MiB by default); a filter that
few records match, or a deep `before` cursor, reaches further back. A rotated file whose first
record is not below the cursor is skipped after reading that one line.

A torn unterminated last line and any line that is not a JSON object with an integer `seq`
are skipped, never raised on. Going back, seq only falls: a record whose seq is not below the
last one returned (a file read twice because it rotated during the search) is skipped.
Records without `"kind"` are requests; for admin records the key filter matches `actor` too.
The end_user filter matches a request's `end_user` or its `end_user_email` (a trusted front's).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import orjson

from zerohop.gateway.audit.log import CONTENT_FIELDS, CURRENT, log_files
from zerohop.gateway.audit.record import AuditRecord

MAX_LIMIT = 1000
KINDS = ("request", "admin")
_STATUS = re.compile(r"[1-5](?:\d\d|xx)")
_UNIX = re.compile(r"\d+(?:\.\d+)?")
# URL query parameter -> AuditQuery field
PARAMS = {
    "api_key_id": "key_id",
    "workspace_id": "tenant",
    "end_user": "end_user",
    "status": "status",
    "kind": "kind",
    "starting_at": "since",
    "ending_at": "until",
    "limit": "limit",
    "before": "before",
}


class QueryError(ValueError):
    """An invalid query; `field` names the AuditQuery field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.reason = field, message


@dataclass(slots=True, frozen=True)
class AuditQuery:
    key_id: str | None = None
    tenant: str | None = None
    status: str | None = None  # "429" or a class "4xx"
    kind: str | None = None  # "request" | "admin"
    since: float | None = None  # unix seconds: since <= time < until
    until: float | None = None
    limit: int = 50
    before: int | None = None  # a cursor: only records with seq < before
    end_user: str | None = None  # a trusted front's user id or email (api/http/trusted_front)

    def __post_init__(self) -> None:
        if self.status is not None and not _STATUS.fullmatch(self.status):
            raise QueryError("status", f"{self.status!r} is not a code (429) or a class (4xx)")
        if self.kind is not None and self.kind not in KINDS:
            raise QueryError("kind", f"{self.kind!r} is not one of {', '.join(KINDS)}")
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise QueryError(name, "must be a finite time")
        if not (isinstance(self.limit, int) and 1 <= self.limit <= MAX_LIMIT):
            raise QueryError("limit", f"must be an integer from 1 to {MAX_LIMIT}")
        if self.before is not None and not (isinstance(self.before, int) and self.before >= 0):
            raise QueryError("before", "must be a record's seq (a non-negative integer)")

    def matches(self, rec: AuditRecord) -> bool:
        kind = rec.get("kind", "request")
        if self.kind is not None and kind != self.kind:
            return False
        if self.key_id is not None and not _key_matches(self.key_id, kind, rec):
            return False
        if self.tenant is not None and self.tenant != rec.get("tenant"):
            return False
        named = (rec.get("end_user"), rec.get("end_user_email"))
        if self.end_user is not None and self.end_user not in named:
            return False
        if self.status is not None and not _status_matches(self.status, rec.get("status")):
            return False
        if self.since is None and self.until is None:
            return True
        stamp = _record_time(rec.get("time"))
        if stamp is None:
            return False
        return (self.since is None or self.since <= stamp) and (
            self.until is None or stamp < self.until
        )


@dataclass(slots=True)
class AuditPage:
    records: list[AuditRecord]  # newest first
    has_more: bool
    next_before: int | None  # the seq of the last record returned, when has_more


def parse_query(params: Mapping[str, str]) -> AuditQuery:
    """An AuditQuery from URL query parameters (see PARAMS); an empty value is no filter."""
    fields: dict[str, object] = {}
    for name, value in params.items():
        if name not in PARAMS:
            raise ValueError(f"{name}: unknown parameter (known: {', '.join(PARAMS)})")
        if value == "":
            continue
        field = PARAMS[name]
        if field in ("since", "until"):
            fields[field] = _parse_time(name, value)
        elif field in ("limit", "before"):
            if not value.isascii() or not value.isdigit() or len(value) > 18:
                raise ValueError(f"{name}: {value!r} is not a non-negative integer")
            fields[field] = int(value)
        else:
            fields[field] = value.lower() if field == "status" else value
    try:
        return AuditQuery(**fields)  # type: ignore[arg-type]
    except QueryError as exc:
        name = next(p for p, f in PARAMS.items() if f == exc.field)
        raise ValueError(f"{name}: {exc.reason}") from None


def search(directory: Path, query: AuditQuery, include_content: bool) -> AuditPage:
    """The newest `query.limit` matching records (with seq < query.before), newest first."""
    found: list[AuditRecord] = []
    for rec in _records(Path(directory), query.before):
        if query.matches(rec):
            found.append(rec)
            if len(found) > query.limit:
                break
    has_more = len(found) > query.limit
    records = found[: query.limit]
    if not include_content:
        for rec in records:
            for key in CONTENT_FIELDS:
                rec.pop(key, None)
    return AuditPage(records, has_more, records[-1]["seq"] if has_more else None)


def _records(directory: Path, before: int | None) -> Iterator[AuditRecord]:
    """Every record with seq < before, newest first; seq falls strictly."""
    ceiling = math.inf if before is None else before
    current = _read(directory / CURRENT)  # before listing: a rotation then only repeats it
    rotated = [p for p in log_files(directory) if p.name != CURRENT] if directory.is_dir() else []
    for path in [None, *reversed(rotated)]:
        data = current if path is None else _read(path, ceiling)
        for line in reversed(data.split(b"\n")[:-1]):  # the last: b"" or a torn tail
            rec = _parse(line)
            if rec is not None and rec["seq"] < ceiling:
                ceiling = rec["seq"]
                yield rec


def _read(path: Path, ceiling: float = math.inf) -> bytes:
    """The file's bytes; b"" if it is gone, or if its first record's seq is not below ceiling."""
    try:
        with path.open("rb") as f:
            first = f.readline()
            if first.endswith(b"\n") and (rec := _parse(first[:-1])) and rec["seq"] >= ceiling:
                return b""
            return first + f.read()
    except (FileNotFoundError, NotADirectoryError):
        return b""


def _parse(line: bytes) -> AuditRecord | None:
    try:
        rec = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(rec, dict) or type(rec.get("seq")) is not int:
        return None
    return rec


def _key_matches(key_id: str, kind: object, rec: AuditRecord) -> bool:
    return rec.get("key_id") == key_id or (kind == "admin" and rec.get("actor") == key_id)


def _status_matches(want: str, status: object) -> bool:
    if isinstance(status, bool) or not isinstance(status, int | str):
        return False
    got = str(status)
    return got == want if want[1:] != "xx" else len(got) == 3 and got[0] == want[0]


def _record_time(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, str):
        return None
    try:
        stamp = datetime.fromisoformat(value)
    except ValueError:
        return None
    return stamp.timestamp() if stamp.tzinfo is not None else None


def _parse_time(name: str, value: str) -> float:
    """RFC 3339 with Z or an offset, or unix seconds."""
    if _UNIX.fullmatch(value):
        return float(value)
    try:
        stamp = datetime.fromisoformat(value)
    except ValueError:
        stamp = None
    if stamp is None or stamp.tzinfo is None:
        raise ValueError(f"{name}: {value!r} is not RFC 3339 with Z or an offset, nor unix seconds")
    return stamp.timestamp()
