"""A fleet's budget through leases, in one process: three replicas' ledgers (each with its
keeper thread) on one real PostgreSQL spend a tenant's budget together, never beyond it, and
use nearly all of it; with PostgreSQL stopped they serve inside their leases only."""

from __future__ import annotations

import asyncio
import random
import time

import psycopg

from tests.pg_fixtures import migrated_database
from tests.postgres_server import PostgresServer
from zerohop.gateway.budgets.lease_keeper import LeaseKeeper, open_leased_ledger
from zerohop.gateway.budgets.leased_ledger import LeasedLedger, LeaseUnavailable
from zerohop.gateway.budgets.sqlite_ledger import BudgetExhausted
from zerohop.gateway.keys.identity import Budget, Identity, Tenant
from zerohop.gateway.store.lease_repository import LeaseRepository

BUDGET = 30_000
PROMPT, MAX_TOKENS = 40, 60


def _identity(budget: int = BUDGET) -> Identity:
    return Identity("zh-abcdefgh", Tenant("acme", budget=Budget(budget, "total")))


def _fleet(url: str, n: int = 3, ttl: float = 6.0) -> list[LeasedLedger]:
    ledgers = [
        open_leased_ledger(LeaseRepository(url), ttl=ttl, heartbeat=0.2, horizon=2.0)
        for _ in range(n)
    ]
    for ledger in ledgers:
        ledger.start()
    return ledgers


def _close(ledgers: list[LeasedLedger]) -> None:
    """Each ledger (its leases returned), then its repository's connection."""
    for ledger in ledgers:
        ledger.close()
        keeper = ledger.keeper
        assert isinstance(keeper, LeaseKeeper)
        keeper.leases.close()


def _settled(url: str) -> tuple[int, int]:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT settled, leased FROM budget_state WHERE subject = 'tenant:acme'"
        ).fetchone()
    return row or (0, 0)


async def _spend(
    ledgers: list[LeasedLedger], identity: Identity, streams: int, use: float = 1.0
) -> dict[str, int]:
    """`streams` workers spend `use` of each reservation until the budget says exhausted."""
    seen = {"used": 0, "exhausted": 0, "unavailable": 0, "clamped": 0}

    async def worker(n: int) -> None:
        rnd = random.Random(n)
        replica = n % len(ledgers)
        for attempt in range(10_000):
            ledger = ledgers[replica]
            await ledger.prepare(identity, PROMPT, MAX_TOKENS)
            try:
                reservation = ledger.reserve(identity, f"r{n}-{attempt}", PROMPT, MAX_TOKENS)
            except BudgetExhausted:
                seen["exhausted"] += 1
                return
            except LeaseUnavailable:
                seen["unavailable"] += 1
                replica = (replica + 1) % len(ledgers)  # as zerohop.client fails over
                await asyncio.sleep(0.02)
                continue
            assert reservation is not None
            seen["clamped"] += reservation.clamped
            await asyncio.sleep(rnd.uniform(0, 0.01))
            reservation.used = int(reservation.reserved * use)  # 1.0: the worst case
            seen["used"] += reservation.used
            ledger.settle(reservation)

    await asyncio.gather(*(worker(n) for n in range(streams)))
    return seen


def test_three_replicas_never_exceed_the_budget_and_use_nearly_all(
    postgres: PostgresServer,
) -> None:
    url = migrated_database(postgres)
    ledgers = _fleet(url)
    try:
        seen = asyncio.run(asyncio.wait_for(_spend(ledgers, _identity(), 48), 60))
    finally:
        _close(ledgers)
    settled, leased = _settled(url)
    assert leased == 0  # every lease returned on close
    assert seen["used"] == settled <= BUDGET
    assert settled >= 0.95 * BUDGET, seen
    assert seen["exhausted"] == 48


def test_the_end_of_a_budget_is_not_stranded_in_remainders(postgres: PostgresServer) -> None:
    # Requests use half their reservation, so every replica is left with remainders too
    # small for one request; pooled through the store, they are used, and the budget ends
    # in seconds, not when idle leases are returned (30 s).
    url = migrated_database(postgres)
    ledgers = _fleet(url)
    try:
        seen = asyncio.run(asyncio.wait_for(_spend(ledgers, _identity(5000), 48, use=0.5), 20))
    finally:
        _close(ledgers)
    settled, _ = _settled(url)
    assert seen["exhausted"] == 48 and seen["used"] == settled
    assert settled > 5000 - (PROMPT + 1), seen  # less than one request's least is left


def test_store_down_serves_inside_leases_only(postgres: PostgresServer) -> None:
    url = migrated_database(postgres)
    ledger = open_leased_ledger(LeaseRepository(url), ttl=30.0, heartbeat=0.2, horizon=10.0)
    ledger.start()
    identity = _identity(100_000)

    async def run() -> tuple[int, int, dict[str, int]]:
        warm = await _spend_some(ledger, identity, 50)  # leases sized from this spend while up
        await asyncio.sleep(0.6)  # topped up ahead of need
        postgres.stop()
        await asyncio.sleep(0.3)
        assert not ledger.keeper.up
        held = min(lease.available(time.monotonic()) for lease in ledger.leases.values())
        return warm["used"], held, await _spend_some(ledger, identity, 400)

    try:
        warm, held, seen = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        postgres.start()
        _close([ledger])
    assert held >= 10 * (PROMPT + MAX_TOKENS)
    assert held - (PROMPT + MAX_TOKENS) < seen["used"] <= held  # what it held, no more
    assert seen["unavailable"] > 0  # beyond: refused as retryable, never admitted
    settled, leased = _settled(url)
    assert leased == 0 and settled == warm + seen["used"]


async def _spend_some(ledger: LeasedLedger, identity: Identity, count: int) -> dict[str, int]:
    seen = {"used": 0, "unavailable": 0}
    for n in range(count):
        await ledger.prepare(identity, PROMPT, MAX_TOKENS)
        try:
            reservation = ledger.reserve(identity, f"s{n}", PROMPT, MAX_TOKENS)
        except LeaseUnavailable:
            seen["unavailable"] += 1
            continue
        assert reservation is not None
        reservation.used = reservation.reserved
        seen["used"] += reservation.used
        ledger.settle(reservation)
    return seen
