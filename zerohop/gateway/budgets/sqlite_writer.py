"""The budget ledger's writer thread: reservations and settlements, group-committed to SQLite.

Every operation queued while a transaction is being written goes into the next one (group
commit), so one commit (and, with `durability="full"`, one fsync) serves many requests. The
writer keeps only that policy; the SQL is the store's (`LedgerRepository.writer`, the
`zerohop.gateway.store.ledger_tables` it opens on the store's file).

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
import logging
import queue
import threading
from dataclasses import dataclass

from zerohop.gateway.store.ledger_tables import (
    DURABILITIES,
    Charge,
    Durability,
    LedgerTables,
    Reserve,
    Settle,
)
from zerohop.gateway.store.repositories import LedgerRepository

__all__ = [
    "DURABILITIES",
    "RETRY_SECONDS",
    "Charge",
    "Durability",
    "LedgerUnavailable",
    "LedgerWriter",
    "ReserveOp",
    "SettleOp",
]

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0
SettleOp = Settle  # the tables write it as queued: nothing awaits it


class LedgerUnavailable(Exception):
    """The ledger could not be written: the reservation is not durable."""


@dataclass(slots=True)
class ReserveOp(Reserve):
    """A reservation, and the admission awaiting its commit on its event loop."""

    done: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop


Op = ReserveOp | SettleOp


class LedgerWriter:
    """One thread that writes the ledger's operations through its tables' own connection."""

    def __init__(self, ledger: LedgerRepository, durability: Durability = "full") -> None:
        assert durability in DURABILITIES, durability
        self.ledger, self.durability = ledger, durability
        self.commits = 0  # transactions written (group commit: fewer than requests)
        self.failing = False  # the last transaction failed; cleared by the next that succeeds
        self.synchronous: int | None = None  # the connection's PRAGMA synchronous (1, 2)
        self._ops: queue.SimpleQueue[Op | None] = queue.SimpleQueue()
        self._retry: dict[str, SettleOp] = {}  # settlements a failed transaction kept
        self._thread: threading.Thread | None = None

    def start(self) -> dict[tuple[str, str], int]:
        """Open the ledger's tables and start the thread; returns the durable spend."""
        tables = self.ledger.writer(self.durability)
        self.synchronous = tables.synchronous
        tables.forget_reservations()
        spend = tables.spend()
        self._thread = threading.Thread(
            target=self._run, args=(tables,), name="zerohop-ledger", daemon=True
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

    def _run(self, tables: LedgerTables) -> None:
        while True:
            batch = self._next_batch()
            stop = None in batch
            ops: list[Op] = [*self._retry.values(), *(o for o in batch if o is not None)]
            self._retry.clear()
            if ops or self.failing:
                self._commit(tables, ops)
            if stop:
                if self._retry:
                    log.error(
                        "budget ledger: %d settlements could not be written; their unused"
                        " tokens stay counted as spent",
                        len(self._retry),
                    )
                tables.close()
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

    def _commit(self, tables: LedgerTables, ops: list[Op]) -> None:
        try:
            if ops:
                tables.commit(ops)
            else:
                tables.probe()
        except Exception as exc:  # a disk error fails these admissions, not the server
            self._failed(tables, exc, ops)
            return
        self.commits += 1
        if self.failing:
            log.warning("budget ledger: writes succeed again")
            self.failing = False
        for op in ops:
            if isinstance(op, ReserveOp):
                _resolve_soon(op, None)

    def _failed(self, tables: LedgerTables, exc: Exception, ops: list[Op]) -> None:
        if not self.failing:
            log.error(
                "budget ledger: cannot write %s (%s: %s); requests with a token budget are"
                " refused until it can",
                tables.path,
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
