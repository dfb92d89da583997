"""The stored-responses table of either store: the responses the OpenAI Responses API keeps
for `store: true` requests, so `GET` and `DELETE /v1/responses/{id}`, its `input_items` and
a later request's `previous_response_id` work on any replica sharing the store.

One row per response, keyed by the response's `id` and owned by a tenant: another tenant
never sees, deletes or overwrites it (a lookup finds nothing, a write of that id is refused).
A row holds:

- `status`: the response's own, one of `STATUSES`. A background response is written
  `queued` or `in_progress` and written again (the same id, the same tenant) when it ends;
  a cancel changes it to `cancelled` only while it is still `queued` or `in_progress`, so a
  finished response is never cancelled.
- `body`: the response object as JSON text, what `GET` returns.
- `items`: JSON text of a list, the conversation items the response saw before its output:
  those it inherited through `previous_response_id`, then its own input. `input_items` lists
  them, and a later `previous_response_id` continues from them and the output items of
  `body`.
- `bytes`: the length of `body` plus `items` (characters, as Python's `len`), `created`
  (unix time of the first write) and `expires` (unix time after which the row is gone).

A background response is also leased (`response_leases`, one row per running response): its
`owner` (the replica id running it) and `lease_until` (unix time), written in the put that
stores it `queued`. The owner renews its leases every tick (`renew`), which also tells it which
of its responses stopped meanwhile (cancelled or failed elsewhere, deleted, expired) and drops
those leases; it `release`s a lease when the response ends. A lease past `lease_until` is a
dead owner's: `expired` lists those responses still `queued` or `in_progress` (for any replica
to fail) and drops the leases of responses that ended.

An expired row (`expires < now`) is gone: a lookup treats it as missing and each put deletes
such rows (the `expires` index). The SQL is written once with `?` placeholders (PostgreSQL's
driver gets `%s`), and every operation is one statement or two in the caller's transaction;
the put is one upsert, so concurrent puts of an id never race.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerohop.gateway.store.usage_tables import for_postgres

_TABLE = """
CREATE TABLE IF NOT EXISTS responses (
    response_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, status TEXT NOT NULL,
    body TEXT NOT NULL, items TEXT NOT NULL, bytes {int} NOT NULL,
    created {real} NOT NULL, expires {real} NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_expires ON responses (expires);
"""
_LEASES = """
CREATE TABLE IF NOT EXISTS response_leases (
    response_id TEXT PRIMARY KEY, owner TEXT NOT NULL, lease_until {real} NOT NULL
);
CREATE INDEX IF NOT EXISTS response_leases_owner ON response_leases (owner);
"""
LEASES_SQLITE = _LEASES.format(real="REAL")
LEASES_POSTGRES = _LEASES.format(real="double precision")
SQLITE_SCHEMA = _TABLE.format(int="INTEGER", real="REAL") + LEASES_SQLITE
POSTGRES_SCHEMA = _TABLE.format(int="bigint", real="double precision")  # the v4 table

STATUSES = ("queued", "in_progress", "completed", "incomplete", "failed", "cancelled")
UNFINISHED = ("queued", "in_progress")  # what set_response_status changes

_PURGE = "DELETE FROM responses WHERE expires < ?"
# Replaces only the same tenant's row: another tenant's leaves the upsert no row changed.
_PUT = (
    "INSERT INTO responses (response_id, tenant, status, body, items, bytes, created, expires)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (response_id) DO UPDATE"
    " SET status = excluded.status, body = excluded.body, items = excluded.items,"
    " bytes = excluded.bytes, expires = excluded.expires"
    " WHERE responses.tenant = excluded.tenant"
)
_LIVE = "response_id = ? AND tenant = ? AND expires >= ?"
_GET = (
    "SELECT status, body, items, (SELECT lease_until FROM response_leases l"
    f" WHERE l.response_id = responses.response_id) AS lease_until FROM responses WHERE {_LIVE}"
)
_DELETE = f"DELETE FROM responses WHERE {_LIVE}"
_QUOTED = ", ".join(f"'{status}'" for status in UNFINISHED)
_UNFINISHED = f"{_LIVE} AND status IN ({_QUOTED})"
_SET_STATUS = f"UPDATE responses SET status = ? WHERE {_UNFINISHED}"
_SET_STATUS_BODY = (
    f"UPDATE responses SET status = ?, body = ?, bytes = ? + length(items) WHERE {_UNFINISHED}"
)

_LEASE = (
    "INSERT INTO response_leases (response_id, owner, lease_until) VALUES (?, ?, ?)"
    " ON CONFLICT (response_id) DO UPDATE SET owner = excluded.owner,"
    " lease_until = excluded.lease_until"
)
_RENEW = "UPDATE response_leases SET lease_until = ? WHERE owner = ?"
# The owner's leases whose response is no longer running: gone, expired or ended.
_STOPPED = (
    "SELECT response_id FROM response_leases l WHERE owner = ? AND NOT EXISTS"
    " (SELECT 1 FROM responses r WHERE r.response_id = l.response_id AND r.expires >= ?"
    f" AND r.status IN ({_QUOTED}))"
)
_RELEASE = "DELETE FROM response_leases WHERE response_id = ?"
_DROP_ENDED = (
    "DELETE FROM response_leases WHERE lease_until < ? AND NOT EXISTS"
    " (SELECT 1 FROM responses r WHERE r.response_id = response_leases.response_id"
    f" AND r.status IN ({_QUOTED}))"
)
_EXPIRED = (
    "SELECT r.tenant, r.response_id, r.body FROM response_leases l"
    " JOIN responses r ON r.response_id = l.response_id"
    f" WHERE l.lease_until < ? AND r.status IN ({_QUOTED}) ORDER BY l.lease_until LIMIT 100"
)


@dataclass(slots=True, frozen=True)
class Lease:
    """A background response's lease: the replica running it, until when unrenewed."""

    owner: str
    until: float


@dataclass(slots=True, frozen=True)
class ExpiredResponse:
    """A response still queued or running whose owner's lease ended."""

    tenant: str
    response_id: str
    body: str


@dataclass(slots=True, frozen=True)
class ResponseRow:
    """A response to store (see the module docstring for the columns)."""

    response_id: str
    tenant: str
    status: str  # one of STATUSES
    body: str  # the response object as JSON text (what GET returns)
    items: str  # JSON text of a list: the items before its output (input_items)
    expires: float  # unix time after which the row is gone
    lease: Lease | None = None  # a background response's, written with it


@dataclass(slots=True, frozen=True)
class StoredResponse:
    """What a lookup of a live row of the tenant finds."""

    status: str
    body: str
    items: str
    lease_until: float | None = None  # its lease's end, while it has one


def check_status(status: str) -> None:
    if status not in STATUSES:
        raise ValueError(f"response status {status!r} is not one of {', '.join(STATUSES)}")


class ResponseTables:
    """The stored-response queries over a DB-API connection of either store (`postgres`: %s)."""

    def __init__(self, postgres: bool) -> None:
        sql = for_postgres if postgres else str
        self.purge, self.put_sql, self.get_sql = sql(_PURGE), sql(_PUT), sql(_GET)
        self.delete_sql = sql(_DELETE)
        self.set_status_sql, self.set_status_body = sql(_SET_STATUS), sql(_SET_STATUS_BODY)
        self.lease_sql, self.renew_sql, self.stopped_sql = sql(_LEASE), sql(_RENEW), sql(_STOPPED)
        self.release_sql, self.drop_ended, self.expired_sql = (
            sql(_RELEASE), sql(_DROP_ENDED), sql(_EXPIRED)
        )  # fmt: skip

    def put(self, cur: Any, row: ResponseRow, now: float) -> None:
        """Store `row` (replacing the tenant's own row of that id); drop expired rows.
        ValueError for an invalid status or an id another tenant's live row holds."""
        check_status(row.status)
        cur.execute(self.purge, (now,))
        size = len(row.body) + len(row.items)
        values = (row.response_id, row.tenant, row.status, row.body, row.items, size, now,
                  row.expires)  # fmt: skip
        if cur.execute(self.put_sql, values).rowcount != 1:
            raise ValueError(f"response id {row.response_id!r} is another tenant's")
        if row.lease is not None:
            cur.execute(self.lease_sql, (row.response_id, row.lease.owner, row.lease.until))

    def get(self, cur: Any, tenant: str, response_id: str, now: float) -> StoredResponse | None:
        """The tenant's live row of that id; None for an unknown, expired or another
        tenant's one (never told apart)."""
        found = cur.execute(self.get_sql, (response_id, tenant, now)).fetchone()
        if found is None:
            return None
        until = found["lease_until"]
        return StoredResponse(found["status"], found["body"], found["items"], until)

    def delete(self, cur: Any, tenant: str, response_id: str, now: float) -> bool:
        """Delete the tenant's live row of that id: True when there was one."""
        return bool(cur.execute(self.delete_sql, (response_id, tenant, now)).rowcount == 1)

    def set_status(
        self, cur: Any, tenant: str, response_id: str, status: str, body: str | None, now: float
    ) -> bool:
        """Change the status (and the body, when given) of the tenant's live row of that id
        while it is `queued` or `in_progress`: True when it changed."""
        check_status(status)
        if body is None:
            done = cur.execute(self.set_status_sql, (status, response_id, tenant, now))
        else:
            params = (status, body, len(body), response_id, tenant, now)
            done = cur.execute(self.set_status_body, params)
        return bool(done.rowcount == 1)

    def renew(self, cur: Any, owner: str, until: float, now: float) -> list[str]:
        """Extend `owner`'s leases to `until`; the ids of its responses that stopped running
        (their leases dropped): the owner aborts those."""
        cur.execute(self.renew_sql, (until, owner))
        stopped = [r["response_id"] for r in cur.execute(self.stopped_sql, (owner, now)).fetchall()]
        for response_id in stopped:
            cur.execute(self.release_sql, (response_id,))
        return stopped

    def release(self, cur: Any, response_id: str) -> None:
        cur.execute(self.release_sql, (response_id,))

    def expired(self, cur: Any, now: float) -> list[ExpiredResponse]:
        """The responses still queued or running whose lease ended before `now` (at most 100
        a call); the ended leases of responses that finished are dropped."""
        cur.execute(self.drop_ended, (now,))
        rows = cur.execute(self.expired_sql, (now,)).fetchall()
        return [ExpiredResponse(r["tenant"], r["response_id"], r["body"]) for r in rows]
