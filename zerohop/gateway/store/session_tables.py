"""The console-sessions table of either store: the operators' console logins
(zerohop.admin.sessions), so any replica sharing the store serves a session and a restart
keeps it.

One row per session, keyed by `session_sha256`, the SHA-256 of the random id its cookie
holds: the id itself is never stored, so the table's rows open no session (and the CSRF
token, derived from the id, is not stored either). A row holds:

- `key_id`: the admin key that logged in (the session ends when that key stops being an
  admin key: the reader checks it against its key index on every request);
- `created`, `last_seen` and `expires` (unix times; `expires` is created + the lifetime);
- `revoked`: the logout's time, NULL while the session may be used.

A row is live while `revoked` is NULL, `expires >= now` and `last_seen >= now - idle` (the
idle timeout is the reader's). Every create first deletes the rows that are neither live nor
revoked-but-recent: an expired row, and any row unseen for the idle timeout (a revoked row
stays that long at most, a record of the logout). Then, past a cap, it deletes the key's
least recently seen rows, then the table's: a flood of logins never holds more than
`max_per_key` rows of a key or `max_rows` in all (give or take the logins racing it). The SQL
is written once with `?` placeholders (PostgreSQL's driver gets `%s`), and every operation is
one statement, or a few in the caller's transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerohop.gateway.store.usage_tables import for_postgres

_TABLE = """
CREATE TABLE IF NOT EXISTS console_sessions (
    session_sha256 TEXT PRIMARY KEY, key_id TEXT NOT NULL,
    created {real} NOT NULL, last_seen {real} NOT NULL, expires {real} NOT NULL,
    revoked {real}
);
CREATE INDEX IF NOT EXISTS console_sessions_key ON console_sessions (key_id, last_seen);
CREATE INDEX IF NOT EXISTS console_sessions_last_seen ON console_sessions (last_seen);
CREATE INDEX IF NOT EXISTS console_sessions_expires ON console_sessions (expires);
"""
SQLITE_SCHEMA = _TABLE.format(real="REAL")
POSTGRES_SCHEMA = _TABLE.format(real="double precision")

_PURGE = "DELETE FROM console_sessions WHERE expires < ? OR last_seen < ?"
_COUNT_KEY = "SELECT count(*) AS n FROM console_sessions WHERE key_id = ?"
_COUNT_ALL = "SELECT count(*) AS n FROM console_sessions"
_EVICT_KEY = (
    "DELETE FROM console_sessions WHERE session_sha256 IN (SELECT session_sha256"
    " FROM console_sessions WHERE key_id = ? ORDER BY last_seen, session_sha256 LIMIT ?)"
)
_EVICT_ALL = (
    "DELETE FROM console_sessions WHERE session_sha256 IN (SELECT session_sha256"
    " FROM console_sessions ORDER BY last_seen, session_sha256 LIMIT ?)"
)
_INSERT = (
    "INSERT INTO console_sessions (session_sha256, key_id, created, last_seen, expires)"
    " VALUES (?, ?, ?, ?, ?)"
)
_LIVE = "session_sha256 = ? AND revoked IS NULL"
_GET = (
    "SELECT session_sha256, key_id, created, last_seen, expires FROM console_sessions"
    f" WHERE {_LIVE} AND expires >= ? AND last_seen >= ?"
)
_TOUCH = f"UPDATE console_sessions SET last_seen = ? WHERE {_LIVE} AND last_seen <= ?"
_REVOKE = f"UPDATE console_sessions SET revoked = ? WHERE {_LIVE}"


@dataclass(slots=True, frozen=True)
class SessionRow:
    """A console session as the table holds it (see the module docstring)."""

    session_sha256: str
    key_id: str
    created: float
    last_seen: float
    expires: float


@dataclass(slots=True, frozen=True)
class SessionCaps:
    """What a create keeps: rows unseen for `idle` seconds go; at most `max_per_key` rows of
    one key and `max_rows` in all stay (the least recently seen go first)."""

    idle: float
    max_per_key: int
    max_rows: int


class SessionTables:
    """The console-session queries over a DB-API connection of either store (`postgres`: %s)."""

    def __init__(self, postgres: bool) -> None:
        sql = for_postgres if postgres else str
        self.purge, self.count_key, self.count_all = sql(_PURGE), sql(_COUNT_KEY), sql(_COUNT_ALL)
        self.evict_key, self.evict_all, self.insert = sql(_EVICT_KEY), sql(_EVICT_ALL), sql(_INSERT)
        self.get_sql, self.touch_sql, self.revoke_sql = sql(_GET), sql(_TOUCH), sql(_REVOKE)

    def create(self, cur: Any, row: SessionRow, caps: SessionCaps) -> None:
        """Store a new session (its `created` is now); make room for it as `caps` say."""
        now = row.created
        cur.execute(self.purge, (now, now - caps.idle))
        held = int(cur.execute(self.count_key, (row.key_id,)).fetchone()["n"])
        if held >= caps.max_per_key:
            cur.execute(self.evict_key, (row.key_id, held - caps.max_per_key + 1))
        held = int(cur.execute(self.count_all).fetchone()["n"])
        if held >= caps.max_rows:
            cur.execute(self.evict_all, (held - caps.max_rows + 1,))
        values = (row.session_sha256, row.key_id, now, now, row.expires)
        cur.execute(self.insert, values)

    def get(self, cur: Any, session_sha256: str, now: float, idle: float) -> SessionRow | None:
        """The live session of that hash, or None (unknown, revoked, expired, idle)."""
        found = cur.execute(self.get_sql, (session_sha256, now, now - idle)).fetchone()
        if found is None:
            return None
        return SessionRow(
            found["session_sha256"], found["key_id"], found["created"], found["last_seen"],
            found["expires"],
        )  # fmt: skip

    def touch(self, cur: Any, session_sha256: str, now: float, every: float) -> bool:
        """Set `last_seen` to now where it is `every` seconds old or more (several replicas
        touching at once write it once): True when it changed."""
        done = cur.execute(self.touch_sql, (now, session_sha256, now - every))
        return bool(done.rowcount == 1)

    def revoke(self, cur: Any, session_sha256: str, now: float) -> bool:
        """Log the session out: True when it was not already."""
        return bool(cur.execute(self.revoke_sql, (now, session_sha256)).rowcount == 1)
