"""The budget ledger's writer thread: reservations and settlements, group-committed to SQLite.

Every operation queued while a transaction is being written goes into the next one (group
commit), so one commit (and, with `durability="full"`, one fsync) serves many requests.

- A reservation adds its tokens to `spend` and records its charges in `reservations`, keyed
  by request id; its future resolves once committed, or fails with `LedgerUnavailable`.
- A settlement gives back the unused part of a reservation, once: it deletes the request's
  `reservations` row, and refunds only if that row was there with the same charges. A
  reservation that never became durable has no row, so it is never refunded; settling twice
  refunds once.
- A failed transaction (disk full, I/O error) is rolled back whole: its reservations fail
  (their requests are refused), its settlements are kept and retried with the next commit
  (until then durable spend is over-counted, never under-counted). While failing, the writer
  tries again every `RETRY_SECONDS` even when nothing is queued, so `failing` clears as soon
  as the disk takes writes again.

Durability: `normal` (SQLite `synchronous=NORMAL` in WAL) loses nothing committed when the
process is killed, but an OS crash or power loss can lose the commits since the last
checkpoint; `full` (`synchronous=FULL`) fsyncs the WAL at every commit and survives both.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from zerohop.gateway.store.sqlite import connect

log = logging.getLogger(__name__)

Charge = tuple[str, str, int]  # (subject, period, tokens)
Durability = Literal["normal", "full"]
DURABILITIES: tuple[Durability, ...] = ("normal", "full")
SYNCHRONOUS = {"normal": "NORMAL", "full": "FULL"}
RETRY_SECONDS = 1.0


class LedgerUnavailable(Exception):
    """The ledger could not be written: the reservation is not durable."""


@dataclass(slots=True)
class ReserveOp:
    request_id: str
    charges: list[Charge]
    done: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop


@dataclass(slots=True)
class SettleOp:
    request_id: str
    charges: list[Charge]  # as reserved
    used: int  # tokens spent; the rest of each charge is given back


Op = ReserveOp | SettleOp


class LedgerWriter:
    """One SQLite connection, owned by one thread, that writes the ledger's operations."""

    def __init__(self, db_path: Path, durability: Durability = "full") -> None:
        assert durability in DURABILITIES, durability
        self.db_path, self.durability = db_path, durability
        self.commits = 0  # transactions written (group commit: fewer than requests)
        self.failing = False  # the last transaction failed; cleared by the next that succeeds
        self.synchronous: int | None = None  # the connection's PRAGMA synchronous (1, 2)
        self._ops: queue.SimpleQueue[Op | None] = queue.SimpleQueue()
        self._retry: dict[str, SettleOp] = {}  # settlements a failed transaction kept
        self._thread: threading.Thread | None = None

    def start(self) -> dict[tuple[str, str], int]:
        """Open the ledger and start the thread; returns the durable spend."""
        conn = connect(self.db_path, synchronous=SYNCHRONOUS[self.durability])
        self.synchronous = conn.execute("PRAGMA synchronous").fetchone()[0]
        _forget_reservations(conn)
        spend = {(s, p): t for s, p, t in conn.execute("SELECT subject, period, tokens FROM spend")}
        self._thread = threading.Thread(
            target=self._run, args=(conn,), name="zerohop-ledger", daemon=True
        )
        self._thread.start()
        return spend

    def submit(self, op: Op) -> None:
        self._ops.put(op)

    def close(self) -> None:
        if self._thread is not None:
            self._ops.put(None)
            self._thread.join()
            self._thread = None

    # -- the thread ---------------------------------------------------------------------------

    def _run(self, conn: sqlite3.Connection) -> None:
        while True:
            batch = self._next_batch()
            stop = None in batch
            ops: list[Op] = [*self._retry.values(), *(o for o in batch if o is not None)]
            self._retry.clear()
            if ops or self.failing:
                self._commit(conn, ops)
            if stop:
                if self._retry:
                    log.error(
                        "budget ledger: %d settlements could not be written; their unused"
                        " tokens stay counted as spent",
                        len(self._retry),
                    )
                conn.close()
                return

    def _next_batch(self) -> list[Op | None]:
        try:
            first = self._ops.get(timeout=RETRY_SECONDS if self.failing else None)
        except queue.Empty:
            return []  # failing and idle: try again (a probe, or the kept settlements)
        batch = [first]
        while not self._ops.empty():
            batch.append(self._ops.get_nowait())
        return batch

    def _commit(self, conn: sqlite3.Connection, ops: list[Op]) -> None:
        try:
            conn.execute("BEGIN IMMEDIATE")
            for op in ops:
                _apply(conn, op)
            if not ops:
                _probe(conn)
            conn.execute("COMMIT")
        except Exception as exc:  # a disk error fails these admissions, not the server
            _rollback(conn)
            self._failed(exc, ops)
            return
        self.commits += 1
        if self.failing:
            log.warning("budget ledger: writes succeed again")
            self.failing = False
        for op in ops:
            if isinstance(op, ReserveOp):
                _resolve_soon(op, None)

    def _failed(self, exc: Exception, ops: list[Op]) -> None:
        if not self.failing:
            log.error(
                "budget ledger: cannot write %s (%s: %s); requests with a token budget are"
                " refused until it can",
                self.db_path,
                type(exc).__name__,
                exc,
            )
            self.failing = True
        error = LedgerUnavailable(str(exc))
        for op in ops:
            if isinstance(op, ReserveOp):
                _resolve_soon(op, error)
            else:
                self._retry[op.request_id] = op


def _apply(conn: sqlite3.Connection, op: Op) -> None:
    charges = json.dumps(op.charges)
    if isinstance(op, ReserveOp):
        _add(conn, op.charges, 1)
        conn.execute(  # the first reservation of a request id is the one settled
            "INSERT OR IGNORE INTO reservations VALUES (?, ?, ?)",
            (op.request_id, charges, time.time()),
        )
        return
    deleted = conn.execute(
        "DELETE FROM reservations WHERE request_id = ? AND charges = ?", (op.request_id, charges)
    )
    if deleted.rowcount == 1:  # durably reserved and not settled yet: give back, once
        refunds = [(s, p, max(0, tokens - op.used)) for s, p, tokens in op.charges]
        _add(conn, refunds, -1)


def _add(conn: sqlite3.Connection, charges: list[Charge], sign: int) -> None:
    for subject, period, tokens in charges:
        conn.execute(
            "INSERT INTO spend (subject, period, tokens) VALUES (?, ?, ?)"
            " ON CONFLICT(subject, period) DO UPDATE SET tokens = tokens + excluded.tokens",
            (subject, period, sign * tokens),
        )


def _probe(conn: sqlite3.Connection) -> None:
    """A write that changes nothing, to learn whether the disk takes writes again."""
    conn.execute("INSERT OR REPLACE INTO reservations VALUES ('', '[]', 0)")
    conn.execute("DELETE FROM reservations WHERE request_id = ''")


def _forget_reservations(conn: sqlite3.Connection) -> None:
    """Reservations a crash left stay counted in full: keep the spend, drop the rows.

    Best effort: on a disk that takes no writes, the rows stay (no request id comes again)."""
    try:
        conn.execute("DELETE FROM reservations")
    except sqlite3.Error as exc:
        log.warning("budget ledger: cannot clear old reservations (%s)", exc)


def _rollback(conn: sqlite3.Connection) -> None:
    with contextlib.suppress(sqlite3.Error):  # SQLite may have rolled back itself
        if conn.in_transaction:
            conn.execute("ROLLBACK")


def _resolve_soon(op: ReserveOp, error: Exception | None) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits it any more
        op.loop.call_soon_threadsafe(_resolve, op.done, error)


def _resolve(future: asyncio.Future[None], error: Exception | None) -> None:
    if future.done():  # cancelled: its request went away while it was written
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
