"""Per-minute limits shared by a fleet (zerohop.gateway.limits.fleet_shares, its SQL in
zerohop.gateway.store.rate_share_tables) on a real PostgreSQL:
shares never sum past 1, follow demand, and three replicas flooding one key admit no more
than one replica holding the whole limit would."""

from __future__ import annotations

import asyncio
import threading
import time

import psycopg
import pytest

from tests.pg_fixtures import migrated_database
from tests.postgres_server import PostgresServer
from zerohop.gateway.keys.identity import Identity, Limits, Tenant
from zerohop.gateway.limits.buckets import RateLimiter
from zerohop.gateway.limits.fleet_shares import FleetRates
from zerohop.gateway.store.lease_repository import LeaseRepository
from zerohop.gateway.store.rate_share_tables import allocate

RPM = 60
IDENTITY = Identity("zh-ratekey", Tenant("acme"), limits=Limits(rpm=RPM))


def test_allocation_is_a_floor_plus_demand_and_sums_to_one() -> None:
    demands = {"a": 3.0, "b": 1.0, "c": 0.0}
    shares = {r: allocate(demands, r) for r in demands}
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["a"] > shares["b"] > shares["c"] > 0
    assert allocate({"a": 0.0, "b": 0.0}, "a") == 0.5


def _total_share(conn: psycopg.Connection, subject: str) -> float:
    (total,) = conn.execute(
        "SELECT coalesce(sum(share), 0) FROM rate_shares WHERE subject = %s AND expires_at > now()",
        (subject,),
    ).fetchone()
    return total


def test_concurrent_rebalancing_never_oversubscribes(postgres: PostgresServer) -> None:
    url, failures = migrated_database(postgres), []

    def replica(name: str, demand: float) -> None:
        leases = LeaseRepository(url)
        with psycopg.connect(url, autocommit=True) as conn:
            for step in range(60):
                leases.rebalance(name, "key:x", demand * (1 + step % 3), 30)
                if (total := _total_share(conn, "key:x")) > 1 + 1e-6:
                    failures.append(total)
        leases.close()

    threads = [threading.Thread(target=replica, args=(f"r{i}", i + 0.5)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


async def _fleet_flood(url: str, seconds: float) -> tuple[int, dict[str, float]]:
    """Three replicas' limiters, rebalanced every 0.2 s, each asked 20 times a second."""
    loop = asyncio.get_running_loop()
    replicas = []
    for i in range(3):
        limiter = RateLimiter()
        rates = FleetRates(limiter, wait=0.5)
        rates.bind(loop)
        replicas.append((f"r{i}", limiter, rates, LeaseRepository(url)))
    admitted = 0
    started = time.monotonic()

    async def beat() -> None:
        while time.monotonic() - started < seconds:
            for name, _, rates, leases in replicas:
                await asyncio.to_thread(rates.beat, leases, name, 30, time.monotonic())
            await asyncio.sleep(0.2)

    beater = asyncio.create_task(beat())
    while time.monotonic() - started < seconds:
        for _, limiter, _, _ in replicas:
            result = limiter.admit(IDENTITY, 10)
            if isinstance(result, list):
                admitted += 1
        await asyncio.sleep(0.05)
    await beater
    shares = {name: limiter.subjects()["key:zh-ratekey"].share for name, limiter, _, _ in replicas}
    for *_, leases in replicas:
        leases.close()
    return admitted, shares


def test_three_replicas_admit_no_more_than_the_limit_allows(postgres: PostgresServer) -> None:
    url = migrated_database(postgres)
    seconds = 3.0
    admitted, shares = asyncio.run(_fleet_flood(url, seconds))
    assert sum(shares.values()) <= 1 + 1e-6
    assert all(share > 0.2 for share in shares.values())  # equal demand, near-equal shares
    # One bucket of RPM plus its refill over the run: what one replica alone would admit.
    assert 0.5 * RPM <= admitted <= RPM + RPM / 60 * seconds + 1
