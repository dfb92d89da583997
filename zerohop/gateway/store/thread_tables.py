"""The message-threads table of either store: the conversations the Anthropic surface keeps
for `thread: {"type": "continue"}` requests (zerohop.api.anthropic.threads).

One row per response that a thread ended at, keyed by the response's `id` (what a continue
names as `previous_message_id`) and owned by a tenant. A row's `state`:

- `open`: `body` holds the thread up to that response; it may be continued, once.
- `in_flight`: a continue from it is running. Another continue is refused until it ends:
  an answer makes the row `continued`, a failed or cancelled one makes it `open` again. A
  replica that died mid-answer leaves the mark until the row expires (the TTL, counted from
  the continue's start), and the client replays the conversation meanwhile.
- `continued`: a later response holds the thread; the row's body is dropped (NULL), so a
  thread takes the space of its latest state only.
- `too_large`: the answer made the thread larger than the server keeps; no body.

A row unused for the TTL is gone: a lookup treats it as missing and each write deletes such
rows (the `used` index). The SQL is written once with `?` placeholders (PostgreSQL's driver
gets `%s`), and every operation runs in the caller's transaction; PostgreSQL reads the row
`FOR UPDATE`, SQLite's `BEGIN IMMEDIATE` already serializes writers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from zerohop.gateway.store.usage_tables import for_postgres

_TABLE = """
CREATE TABLE IF NOT EXISTS message_threads (
    message_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, state TEXT NOT NULL,
    body TEXT, bytes {int} NOT NULL, turns {int} NOT NULL,
    created {real} NOT NULL, used {real} NOT NULL
);
CREATE INDEX IF NOT EXISTS message_threads_used ON message_threads (used);
"""
SQLITE_SCHEMA = _TABLE.format(int="INTEGER", real="REAL")
POSTGRES_SCHEMA = _TABLE.format(int="bigint", real="double precision")

STATES = ("open", "in_flight", "continued", "too_large")
_SELECT = "SELECT tenant, state, body, bytes, turns, used FROM message_threads WHERE message_id = ?"
_MARK = "UPDATE message_threads SET state = ?, used = ? WHERE message_id = ?"
_CONTINUED = (
    "UPDATE message_threads SET state = 'continued', body = NULL, used = ? WHERE message_id = ?"
)
_RELEASE = (
    "UPDATE message_threads SET state = 'open', used = ?"
    " WHERE message_id = ? AND tenant = ? AND state = 'in_flight'"
)
_INSERT = (
    "INSERT INTO message_threads (message_id, tenant, state, body, bytes, turns, created, used)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
_PURGE = "DELETE FROM message_threads WHERE used < ?"

Outcome = Literal["taken", "not_found", "continued", "in_flight", "too_large"]


@dataclass(slots=True, frozen=True)
class Taken:
    """What taking a thread's row for a continue found. `body` (the stored JSON) and
    `turns` are set when `outcome` is "taken"."""

    outcome: Outcome
    body: str | None = None
    turns: int = 0


@dataclass(slots=True, frozen=True)
class NewThreadRow:
    """A response's thread state to store: `body` None for a `too_large` tombstone."""

    message_id: str
    tenant: str
    body: str | None
    bytes: int
    turns: int
    continues: str | None = None  # the row it continued from, now `continued`


class ThreadTables:
    """The thread queries over a DB-API connection of either store (`postgres`: %s)."""

    def __init__(self, postgres: bool) -> None:
        sql = for_postgres if postgres else str
        self.select = sql(_SELECT + (" FOR UPDATE" if postgres else ""))
        self.mark, self.continued, self.release_sql = sql(_MARK), sql(_CONTINUED), sql(_RELEASE)
        self.insert, self.purge = sql(_INSERT), sql(_PURGE)

    def take(self, cur: Any, tenant: str, message_id: str, now: float, ttl: float) -> Taken:
        """Mark the thread that ends at `message_id` in flight and return it, or say why
        not. Another tenant's row, like an expired one, is "not_found": never told apart."""
        row = cur.execute(self.select, (message_id,)).fetchone()
        if row is None or row["tenant"] != tenant or row["used"] < now - ttl:
            return Taken("not_found")
        state = row["state"]
        if state in ("continued", "too_large"):
            return Taken(state)
        if state == "in_flight":
            return Taken("in_flight")
        cur.execute(self.mark, ("in_flight", now, message_id))
        return Taken("taken", row["body"], int(row["turns"]))

    def put(self, cur: Any, new: NewThreadRow, now: float, ttl: float) -> None:
        """Store a response's thread (and retire the row it continued); drop expired rows."""
        cur.execute(self.purge, (now - ttl,))
        if new.continues is not None:
            cur.execute(self.continued, (now, new.continues))
        state = "open" if new.body is not None else "too_large"
        cur.execute(
            self.insert,
            (new.message_id, new.tenant, state, new.body, new.bytes, new.turns, now, now),
        )

    def release(self, cur: Any, tenant: str, message_id: str, now: float) -> None:
        """A continue from `message_id` ended without an answer: it may be continued again."""
        cur.execute(self.release_sql, (now, message_id, tenant))
