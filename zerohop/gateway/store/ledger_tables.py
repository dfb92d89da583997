"""The budget ledger's tables on SQLite (`spend`, `reservations`), as its writer thread
writes them: the durable spend, reservations and settlements in one transaction, a probe.

The ledger has a connection of its own to the store's file, the one exception to "no
per-consumer connection" (`zerohop.gateway.store.repositories`), for three reasons:

- its group-commit writer (`zerohop.gateway.budgets.sqlite_writer`) holds one transaction
  across many requests' reservations on its own thread; on the store's shared connection that
  transaction would take in (or be broken by) every other consumer's statements;
- `--durability` is `PRAGMA synchronous`, which SQLite sets per connection: `normal` for the
  ledger must not weaken the key store's own `FULL`;
- in WAL mode a second connection's readers see the last commit while it writes, so the
  store's readers (keys, reports) are never held behind the ledger's fsyncs.

Semantics the ledger relies on (keep them): a reservation adds its tokens to `spend` and
records its charges under its request id, the first reservation of a request id winning; a
settlement deletes that row when it has the same charges and only then refunds
max(0, tokens - used) per charge, so settling twice, or settling what never became durable,
refunds nothing.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from zerohop.gateway.store.sqlite import connect

log = logging.getLogger(__name__)

Charge = tuple[str, str, int]  # (subject, period, tokens)
Durability = Literal["normal", "full"]
DURABILITIES: tuple[Durability, ...] = ("normal", "full")
SYNCHRONOUS: dict[Durability, str] = {"normal": "NORMAL", "full": "FULL"}


@dataclass(slots=True)
class Reserve:
    """Add `charges` to the spend and record them under the request id."""

    request_id: str
    charges: list[Charge]


@dataclass(slots=True)
class Settle:
    """Give back the unused part of the request id's reservation, once."""

    request_id: str
    charges: list[Charge]  # as reserved
    used: int  # tokens spent; the rest of each charge is given back


LedgerOp = Reserve | Settle


class LedgerTables:
    """One connection to the store's SQLite file, used by one thread at a time."""

    def __init__(self, path: Path, durability: Durability) -> None:
        assert durability in DURABILITIES, durability
        self.path = path
        self._conn = connect(path, synchronous=SYNCHRONOUS[durability])

    @property
    def synchronous(self) -> int:
        """The connection's PRAGMA synchronous (1: NORMAL, 2: FULL)."""
        return int(self._conn.execute("PRAGMA synchronous").fetchone()[0])

    def spend(self) -> dict[tuple[str, str], int]:
        """The durable spend per (subject, period)."""
        rows = self._conn.execute("SELECT subject, period, tokens FROM spend")
        return {(subject, period): tokens for subject, period, tokens in rows}

    def forget_reservations(self) -> None:
        """Reservations a crash left stay counted in full: keep the spend, drop the rows.

        Best effort: on a disk that takes no writes, the rows stay (no request id comes
        again)."""
        try:
            self._conn.execute("DELETE FROM reservations")
        except sqlite3.Error as exc:
            log.warning("budget ledger: cannot clear old reservations (%s)", exc)

    def commit(self, ops: Sequence[LedgerOp]) -> None:
        """`ops` in one transaction, rolled back whole (and the error raised) if it fails."""
        with _transaction(self._conn):
            for op in ops:
                self._apply(op)

    def probe(self) -> None:
        """A write that changes nothing, to learn whether the disk takes writes again."""
        with _transaction(self._conn):
            self._conn.execute("INSERT OR REPLACE INTO reservations VALUES ('', '[]', 0)")
            self._conn.execute("DELETE FROM reservations WHERE request_id = ''")

    def close(self) -> None:
        self._conn.close()

    def _apply(self, op: LedgerOp) -> None:
        charges = json.dumps(op.charges)
        if isinstance(op, Reserve):
            self._add(op.charges, 1)
            self._conn.execute(  # the first reservation of a request id is the one settled
                "INSERT OR IGNORE INTO reservations VALUES (?, ?, ?)",
                (op.request_id, charges, time.time()),
            )
            return
        deleted = self._conn.execute(
            "DELETE FROM reservations WHERE request_id = ? AND charges = ?",
            (op.request_id, charges),
        )
        if deleted.rowcount == 1:  # durably reserved and not settled yet: give back, once
            refunds = [(s, p, max(0, tokens - op.used)) for s, p, tokens in op.charges]
            self._add(refunds, -1)

    def _add(self, charges: Sequence[Charge], sign: int) -> None:
        for subject, period, tokens in charges:
            self._conn.execute(
                "INSERT INTO spend (subject, period, tokens) VALUES (?, ?, ?)"
                " ON CONFLICT(subject, period) DO UPDATE SET tokens = tokens + excluded.tokens",
                (subject, period, sign * tokens),
            )


@contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE ... COMMIT, rolled back whole on any error (a failed COMMIT too)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        with suppress(sqlite3.Error):  # SQLite may have rolled back itself
            if conn.in_transaction:
                conn.execute("ROLLBACK")
        raise
