"""The signing-keys table of either store: the secrets the server signs its own tokens with
(the thoughts of thinking blocks: zerohop.api.serving.thought_signatures), kept where
every replica of a fleet and every restart of one finds them.

Keys are numbered per `purpose`: `generation` 1 is the first, each rotation adds the next.
Adding a generation is an insert-if-absent on (purpose, generation), so replicas that rotate
at once make one key between them and each reads back the same one. A row holds `key_id`
(public: it leads each signature; unique in the table), `secret` (hex text of random bytes)
and `created` (unix time). Which keys still verify is the reader's rule
(zerohop.gateway.server_keys); `drop` deletes the generations before the oldest it keeps.

The secrets are stored as they are, not hashed (the server needs them to sign): whoever can
read the store can sign, as whoever can write it can make keys. The SQL is written once with
`?` placeholders (PostgreSQL's driver gets `%s`), and every operation is one statement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerohop.gateway.store.usage_tables import for_postgres

_TABLE = """
CREATE TABLE IF NOT EXISTS signing_keys (
    purpose TEXT NOT NULL, generation {int} NOT NULL, key_id TEXT NOT NULL UNIQUE,
    secret TEXT NOT NULL, created {real} NOT NULL,
    PRIMARY KEY (purpose, generation)
);
"""
SQLITE_SCHEMA = _TABLE.format(int="INTEGER", real="REAL")
POSTGRES_SCHEMA = _TABLE.format(int="bigint", real="double precision")

_SELECT = (
    "SELECT generation, key_id, secret, created FROM signing_keys WHERE purpose = ?"
    " ORDER BY generation"
)
_ADD = (
    "INSERT INTO signing_keys (purpose, generation, key_id, secret, created)"
    " VALUES (?, ?, ?, ?, ?) ON CONFLICT (purpose, generation) DO NOTHING"
)
_DROP = "DELETE FROM signing_keys WHERE purpose = ? AND generation < ?"


@dataclass(slots=True, frozen=True)
class SigningKeyRow:
    """One key of a purpose (see the module docstring for the columns)."""

    purpose: str
    generation: int
    key_id: str
    secret: str  # hex
    created: float


class SigningKeyTables:
    """The signing-key queries over a DB-API connection of either store (`postgres`: %s)."""

    def __init__(self, postgres: bool) -> None:
        sql = for_postgres if postgres else str
        self.select_sql, self.add_sql, self.drop_sql = sql(_SELECT), sql(_ADD), sql(_DROP)

    def keys(self, cur: Any, purpose: str) -> list[SigningKeyRow]:
        """The purpose's keys, oldest generation first."""
        rows = cur.execute(self.select_sql, (purpose,)).fetchall()
        return [
            SigningKeyRow(purpose, r["generation"], r["key_id"], r["secret"], r["created"])
            for r in rows
        ]

    def add(self, cur: Any, row: SigningKeyRow) -> bool:
        """Add `row` unless its generation exists: True when this one was added (False: a
        replica that rotated at the same time made that generation first)."""
        values = (row.purpose, row.generation, row.key_id, row.secret, row.created)
        return bool(cur.execute(self.add_sql, values).rowcount == 1)

    def drop(self, cur: Any, purpose: str, below: int) -> int:
        """Delete the purpose's generations before `below`: how many."""
        return int(cur.execute(self.drop_sql, (purpose, below)).rowcount)
