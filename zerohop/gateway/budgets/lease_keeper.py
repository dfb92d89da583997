"""The thread that keeps a replica's budget leases: renew, top up, report, give back, sweep.

Every `heartbeat` seconds it renews this replica and all its leases in one transaction and
charges the leases of replicas that stopped renewing theirs (`LeaseRepository.sweep`). Between
heartbeats it wakes when the request path pokes it (a lease running low, a request waiting
for a top-up) and changes each lease that needs it, one transaction per lease. While
PostgreSQL cannot be reached it retries with a growing pause, and the replica serves inside
the leases it holds until their local deadlines pass (`LocalLease.usable_until`). Its
transactions are the store's lease repository's (`zerohop.gateway.store.lease_repository`),
on the connection that repository keeps for this thread.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psycopg

from zerohop.gateway.budgets.leased_ledger import LeasedLedger, LocalLease, Waiter
from zerohop.gateway.budgets.ledger import RateShares
from zerohop.gateway.store.lease_repository import LeaseRepository
from zerohop.gateway.store.lease_tables import LeaseChange, LeaseReply

log = logging.getLogger(__name__)
_T = TypeVar("_T")
IDLE_CLOSE = 30.0  # seconds without a reservation: an idle replica gives its lease back
REPORT_INTERVAL = 5.0  # seconds: spend reaches `zerohop keys usage` within this
JUST_GRANTED = 0.5  # seconds: a top-up's waiting requests reserve it well within this
BACKOFF = (0.2, 5.0)  # seconds: first and longest pause between attempts while down


def new_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


RESULTS = ("full", "partial", "none", "error")


@dataclass(slots=True)
class LeaseStats:
    """What `/metrics` shows of the leases (read by the scrape, written by the keeper)."""

    up: bool = False
    renewals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESULTS, 0))
    returned_tokens: int = 0
    expiries: int = 0  # leases this replica's sweeps charged (of replicas that stopped)
    errors: int = 0
    latency: Latency = field(default_factory=lambda: Latency())  # per transaction
    last_error: str = ""


LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(slots=True)
class Latency:
    """A histogram of the store's transaction times (cumulative counts, as Prometheus)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.total += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def buckets(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, count in zip((*map(str, LATENCY_BUCKETS), "+Inf"), self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


@dataclass(slots=True, frozen=True)
class Plan:
    lease: LocalLease
    change: LeaseChange
    waiters: list[Waiter]


class LeaseKeeper:
    def __init__(
        self,
        ledger: LeasedLedger,
        leases: LeaseRepository,
        *,
        ttl: float,
        heartbeat: float,
        replica_id: str | None = None,
        version: str = "",
    ) -> None:
        self.ledger = ledger
        self.leases = leases  # the store's; it keeps this thread's connection
        self.ttl, self.heartbeat = ttl, heartbeat
        self.margin = max(min(2.0, ttl / 4), ttl / 10)  # local deadline before PostgreSQL's
        self.replica_id = replica_id or new_replica_id()
        self.version = version
        self.stats = LeaseStats()
        self.rates: RateShares | None = None  # renewed with each heartbeat (share_rates)
        self.beat_at = time.monotonic()  # the last heartbeat PostgreSQL answered
        self._wake = threading.Event()
        self._stopping = False
        self._pause = 0.0
        self._next_attempt = 0.0
        self._thread = threading.Thread(target=self._run, name="zerohop-leases", daemon=True)

    def share_rates(self, rates: RateShares) -> None:
        """Renew `rates` with each heartbeat from now on."""
        self.rates = rates

    @property
    def up(self) -> bool:
        """The last transaction succeeded."""
        return self.stats.up

    @property
    def failing(self) -> bool:
        """The last attempt failed (before the first one: not failing, worth waiting for)."""
        return not self.stats.up and self.stats.errors > 0

    def start(self) -> None:
        self._thread.start()

    def poke(self) -> None:
        if not self._wake.is_set():
            self._wake.set()

    def retry_after(self) -> float:
        return max(1.0, self._next_attempt - time.monotonic())

    def close(self) -> None:
        """Stop, then report every lease and give back what it holds (drain). The
        repository's connection stays the store's to close."""
        self._stopping = True
        self.poke()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)
        try:
            self._return_all()
        except psycopg.Error as exc:
            log.warning("leases: not returned (they expire in %.0f s): %s", self.ttl, exc)

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stopping:
            self._wake.wait(max(0.0, next_beat - time.monotonic()))
            self._wake.clear()
            if self._stopping:
                return
            try:
                if time.monotonic() >= next_beat:
                    self._beat()
                    next_beat = time.monotonic() + self.heartbeat
                self._tend()
                self._pause = 0.0
            except psycopg.Error as exc:
                self._down(exc)
                self._wake.wait(self._pause)
                next_beat = 0.0

    def _down(self, exc: psycopg.Error) -> None:
        if self.stats.up or not self.stats.last_error:
            log.warning("leases: the budget store is unreachable: %s", _first_line(exc))
        self.stats.up, self.stats.errors = False, self.stats.errors + 1
        self.stats.last_error = _first_line(exc)  # the repository closed its connection
        if self.rates is not None and time.monotonic() - self.beat_at > self.ttl - self.margin:
            self.rates.fall_back()
        self._pause = min(BACKOFF[1], max(BACKOFF[0], self._pause * 2))
        self._next_attempt = time.monotonic() + self._pause
        with self.ledger.lock:
            for lease in self.ledger.leases.values():
                _wake_waiters(lease.waiters)
                lease.waiters = []

    def _timed(self, work: Callable[[], _T]) -> _T:
        started = time.perf_counter()
        result = work()
        self.stats.latency.observe(time.perf_counter() - started)
        if self.failing:
            log.info("leases: the budget store answers again")
        self.stats.up = True
        return result

    def _beat(self) -> None:
        sent = time.monotonic()
        beat = self._timed(
            lambda: self.leases.heartbeat(
                self.replica_id, self.ttl, socket.gethostname(), self.version
            )
        )
        self.beat_at = sent
        with self.ledger.lock:
            for lease in list(self.ledger.leases.values()):
                if lease.lease_id in beat.renewed:
                    lease.usable_until = sent + self.ttl - self.margin
                    # What the fleet has left, fresh each second: so a replica that has
                    # not changed its lease lately still learns when it runs scarce.
                    settled, leased = beat.renewed[lease.lease_id]
                    lease.free = lease.limit - settled - leased
                    lease.held_elsewhere = leased - (lease.granted - lease.reported)
                elif lease.lease_id is not None:  # swept: it had expired
                    lease.usable_until = 0.0
                    self.ledger.replace(lease)
        if (rates := self.rates) is not None:
            rates.replicas = beat.replicas
            self._timed(lambda: rates.beat(self.leases, self.replica_id, self.ttl, sent))
        charged = self._timed(self.leases.sweep)
        if charged:
            self.stats.expiries += len(charged)
            log.info("leases: charged %d expired leases of stopped replicas", len(charged))

    def _tend(self) -> None:
        if (rates := self.rates) is not None and rates.waiting():
            self._timed(
                lambda: rates.beat(
                    self.leases, self.replica_id, self.ttl, time.monotonic(), only_waiting=True
                )
            )
        for plan in self._plans():
            sent = time.monotonic()
            try:
                change = functools.partial(
                    self.leases.change, self.replica_id, plan.change, self.ttl
                )
                reply = self._timed(change)
            except psycopg.Error:
                self.stats.renewals["error"] += plan.change.want > 0
                with self.ledger.lock:
                    _wake_waiters(plan.waiters)
                raise
            self._apply(plan, reply, sent)

    # -- deciding and applying ---------------------------------------------------------------

    def _plans(self) -> list[Plan]:
        plans = []
        now = time.monotonic()
        with self.ledger.lock:
            for lease in list(self.ledger.leases.values()):
                plan = self._plan(lease, now)
                if plan is not None:
                    plans.append(plan)
        return plans

    def _plan(self, lease: LocalLease, now: float) -> Plan | None:
        """What `lease` needs now (called under the ledger's lock)."""
        available = lease.available(now)
        target = lease.target(self.ledger.horizon, now)
        scarce = lease.scarce(self.ledger.horizon, now)
        waiters, lease.waiters = lease.waiters, []
        # Not while the requests it was just topped up for are still on their way to it.
        settled = now - max(lease.answered_at, lease.last_reserved) > 2 * self.heartbeat
        want, give_back, share, close, at_least = 0, 0, 0.5, False, 0
        if waiters and scarce and lease.lease_id is not None:
            # Pool what it holds with what the fleet has free and take back what the waiting
            # requests need, in one transaction: remainders too small to serve a request,
            # each held by another replica, would otherwise strand the end of the budget.
            # Too little to serve one (at_least): leave it free for another replica to gather.
            give_back, want, share = available, sum(w.need for w in waiters), 1.0
            at_least = min(w.minimum for w in waiters)
        elif waiters:
            want, share = sum(w.need for w in waiters) - available + (0 if scarce else target), 1.0
        elif (
            lease.lease_id is not None
            and lease.open == 0
            and now - lease.last_reserved > IDLE_CLOSE
        ):
            close = True
            self.ledger.replace(lease)  # later requests open a fresh lease
            lease.usable_until = 0.0
        elif lease.lease_id is not None and scarce:
            # Hold one whole request's worth at most, and not a remainder too small for one:
            # a remainder held here would strand the end of the budget, waiting requests on
            # other replicas can use it. Only waiting requests get grants while it is scarce.
            keep = lease.peak if available >= lease.peak else 0
            just_granted = now - lease.answered_at < JUST_GRANTED
            give_back = 0 if just_granted else max(0, available - keep)
        elif lease.lease_id is not None and available > 2 * target and settled:
            give_back = available - target
        elif available < target // 2 and not scarce:  # (nothing free is scarce too)
            want = target - available
        report = lease.spent != lease.reported and now - lease.reported_at >= REPORT_INTERVAL
        if not (want > 0 or give_back or close or report):
            _wake_waiters(waiters)  # covered meanwhile: reserve now
            return None
        lease.granted -= give_back  # before PostgreSQL hears of it: never more than it counts
        change = LeaseChange(
            lease.subject, lease.period, lease.limit, lease.lease_id,
            spent=lease.spent, give_back=give_back, want=max(want, 0), share=share, close=close,
            at_least=at_least,
        )  # fmt: skip
        return Plan(lease, change, waiters)

    def _apply(self, plan: Plan, reply: LeaseReply, sent: float) -> None:
        lease, change = plan.lease, plan.change
        stats = self.stats
        stats.returned_tokens += change.give_back
        if change.want:
            result = "full" if reply.added >= change.want else "partial" if reply.added else "none"
            stats.renewals[result] += 1
        with self.ledger.lock:
            if reply.lost:
                lease.usable_until = 0.0
                self.ledger.replace(lease)
                fresh = self.ledger.leases.get((lease.subject, lease.period))
                if fresh is not None:
                    fresh.waiters.extend(plan.waiters)
                    self.poke()
                return
            if change.close:
                stats.returned_tokens += lease.granted - change.spent
            else:
                lease.lease_id = reply.lease_id
                if reply.lease_id is not None:
                    lease.granted = reply.granted
                    lease.usable_until = sent + self.ttl - self.margin
            lease.reported, lease.reported_at = change.spent, time.monotonic()
            lease.free, lease.held_elsewhere = reply.free, reply.held_elsewhere
            lease.answered_at = time.monotonic()
            _wake_waiters(plan.waiters)

    def _return_all(self) -> None:
        with self.ledger.lock:
            held = [lease for lease in self.ledger.leases.values() if lease.lease_id is not None]
            for lease in held:
                lease.usable_until = 0.0
        for lease in held:
            spent = lease.spent + lease.open  # anything still open counts in full
            change = LeaseChange(
                lease.subject, lease.period, lease.limit, lease.lease_id, spent=spent, close=True
            )
            self.leases.change(self.replica_id, change, self.ttl)
            self.stats.returned_tokens += max(0, lease.granted - spent)
        self.leases.forget_replica(self.replica_id)
        log.info("leases: %d leases returned", len(held))


def _wake_waiters(waiters: list[Waiter]) -> None:
    for waiter in waiters:
        with contextlib.suppress(RuntimeError):  # its loop has closed: nobody waits
            waiter.loop.call_soon_threadsafe(_resolve, waiter.future)


def _resolve(future: Any) -> None:
    if not future.done():
        future.set_result(None)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def open_leased_ledger(
    leases: LeaseRepository,
    *,
    lease_wait: float = 0.25,
    horizon: float = 10.0,
    ttl: float = 60.0,
    heartbeat: float | None = None,
    version: str = "",
) -> LeasedLedger:
    """A fleet replica's ledger and its keeper (started by `ledger.start()`), whose
    transactions are `leases`' (the store's lease repository, `Store.leases`)."""
    ledger = LeasedLedger(lease_wait, horizon)
    beat = heartbeat if heartbeat is not None else min(1.0, ttl / 4)
    ledger.keeper = LeaseKeeper(ledger, leases, ttl=ttl, heartbeat=beat, version=version)
    return ledger
