"""Token budgets that are never exceeded, not even across a crash.

A budget is a number of tokens (uncached input + output) per UTC day, per UTC month, or in
total, for a key and for its tenant. Admission reserves prompt + max_tokens (max_tokens
clamped to what remains) against every budget that applies, in memory at once, and durably
before the request reaches the engine: reservations of concurrent admissions are written
in one SQLite transaction by a writer thread (group commit), and each request awaits its
own commit without blocking the event loop. The ledger row already counts the whole
reservation; when the request ends the unused part is given back. So a crash (kill -9)
between the two leaves the reservation counted in full: spend can be over-counted by a
crash, never under-counted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from zerohop.gateway.identity import Budget, Identity
from zerohop.gateway.store import connect

log = logging.getLogger(__name__)

Charge = tuple[str, str, int]  # (subject, period, tokens)


class BudgetExhausted(Exception):
    """Not even the prompt plus one output token fits in what remains."""


def period_key(period: str, now: float | None = None) -> str:
    moment = datetime.fromtimestamp(time.time() if now is None else now, UTC)
    if period == "day":
        return "day:" + moment.strftime("%Y-%m-%d")
    if period == "month":
        return "month:" + moment.strftime("%Y-%m")
    return "total"


@dataclass(slots=True)
class Reservation:
    request_id: str
    charges: list[Charge]  # what was reserved, per (subject, period)
    max_tokens: int  # granted (clamped) max_tokens
    clamped: bool
    durable: asyncio.Future | None = None
    used: int = 0  # tokens spent so far (uncached input + output), settled per step
    settled: bool = False

    @property
    def reserved(self) -> int:
        return self.charges[0][2] if self.charges else 0


@dataclass(slots=True)
class _Op:
    kind: str  # "reserve" | "settle"
    request_id: str
    charges: list[Charge]
    done: asyncio.Future | None = None
    loop: asyncio.AbstractEventLoop | None = None


class BudgetLedger:
    """In-memory spend per (subject, period), kept durable by a group-committing writer."""

    def __init__(self, db_path: Path) -> None:
        self.db_path = db_path
        self.spent: dict[tuple[str, str], int] = defaultdict(int)
        self._ops: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.commits = 0  # transactions written (group commit: fewer than requests)

    def start(self) -> None:
        conn = connect(self.db_path)
        # Reservations left by a crash stay counted in full: forget them, keep the spend.
        conn.execute("DELETE FROM reservations")
        for subject, period, tokens in conn.execute("SELECT subject, period, tokens FROM spend"):
            self.spent[(subject, period)] = tokens
        self._thread = threading.Thread(
            target=self._write_loop, args=(conn,), name="zerohop-ledger", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._ops.put(None)
            self._thread.join()
            self._thread = None

    # -- the request path (event loop) ----------------------------------------------------

    def reserve(
        self, identity: Identity, request_id: str, prompt: int, max_tokens: int
    ) -> Reservation | None:
        """Reserve prompt + max_tokens (clamped) on every budget of the key and its tenant;
        None when neither has a budget."""
        budgets = _budgets_of(identity)
        if not budgets:
            return None
        now = time.time()
        keys = [(subject, period_key(budget.period, now)) for subject, budget in budgets]
        room = min(b.tokens - self.spent[k] for (_, b), k in zip(budgets, keys, strict=True))
        if room < prompt + 1:
            raise BudgetExhausted(
                f"token budget exhausted: {max(room, 0)} tokens left, the prompt alone is"
                f" {prompt} tokens"
            )
        granted = min(max_tokens, room - prompt)
        reserved = prompt + granted
        charges = [(subject, period, reserved) for subject, period in keys]
        for key in keys:
            self.spent[key] += reserved
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._ops.put(_Op("reserve", request_id, charges, done, loop))
        return Reservation(request_id, charges, granted, granted < max_tokens, done)

    def settle(self, reservation: Reservation) -> None:
        """Give back what the request did not use; durable soon after, awaited by nobody."""
        if reservation.settled:
            return
        reservation.settled = True
        unused = max(0, reservation.reserved - reservation.used)
        refunds = [(s, p, -unused) for s, p, _ in reservation.charges]
        for subject, period, delta in refunds:
            self.spent[(subject, period)] += delta
        self._ops.put(_Op("settle", reservation.request_id, refunds))

    # -- the writer thread ------------------------------------------------------------------

    def _write_loop(self, conn) -> None:
        while True:
            op = self._ops.get()
            batch = [op]
            while not self._ops.empty():
                batch.append(self._ops.get_nowait())
            stop = None in batch
            ops = [o for o in batch if o is not None]
            if ops:
                self._commit(conn, ops)
            if stop:
                conn.close()
                return

    def _commit(self, conn, ops: list[_Op]) -> None:
        error: Exception | None = None
        try:
            conn.execute("BEGIN IMMEDIATE")
            for op in ops:
                self._apply(conn, op)
            conn.execute("COMMIT")
            self.commits += 1
        except Exception as exc:  # a disk error fails these admissions, not the server
            log.exception("budget ledger write failed")
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            error = exc
        for op in ops:
            if op.done is not None and op.loop is not None:
                op.loop.call_soon_threadsafe(_resolve, op.done, error)

    @staticmethod
    def _apply(conn, op: _Op) -> None:
        for subject, period, tokens in op.charges:
            conn.execute(
                "INSERT INTO spend (subject, period, tokens) VALUES (?, ?, ?)"
                " ON CONFLICT(subject, period) DO UPDATE SET tokens = tokens + excluded.tokens",
                (subject, period, tokens),
            )
        if op.kind == "reserve":
            conn.execute(
                "INSERT OR REPLACE INTO reservations VALUES (?, ?, ?)",
                (op.request_id, json.dumps(op.charges), time.time()),
            )
        else:
            conn.execute("DELETE FROM reservations WHERE request_id = ?", (op.request_id,))


def _resolve(future: asyncio.Future, error: Exception | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _budgets_of(identity: Identity) -> list[tuple[str, Budget]]:
    pairs = []
    if identity.budget is not None:
        pairs.append((f"key:{identity.key_id}", identity.budget))
    if identity.tenant.budget is not None:
        pairs.append((f"tenant:{identity.tenant.name}", identity.tenant.budget))
    return pairs
