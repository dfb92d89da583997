"""Part 1a of benchmarks/fleet.py: what the shared store adds to a budgeted request in this
process (the gateway's admit, token steps and release on uvloop), against SQLite and no budget."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import print_table
from _fleet_base import ADDED_TARGET_MS, BIG_BUDGET, diff, fmt, median, percentile

from zerohop.gateway.fleet_options import LeaseOptions
from zerohop.gateway.gateway import Call, Gateway, GatewayError
from zerohop.gateway.keys.identity import Budget, Tenant
from zerohop.gateway.store.postgres import PostgresStore
from zerohop.gateway.store.spec import StoreSpec
from zerohop.gateway.store.sqlite import KeyStore

# -- 1a: the gateway in this process ----------------------------------------------------------


@dataclass(slots=True)
class InprocMode:
    name: str
    gateway: Gateway
    key: str
    seconds: list[float] = field(default_factory=list)
    refused: Counter = field(default_factory=Counter)
    store_transactions: int = 0  # the lease keeper's, during this mode's timed rounds
    sqlite_commits: int = 0  # the SQLite ledger's, during this mode's timed rounds


def keeper_transactions(gateway: Gateway) -> int:
    keeper = getattr(gateway.ledger, "keeper", None)
    return 0 if keeper is None else sum(keeper.stats.latency.counts)


def ledger_commits(gateway: Gateway) -> int:
    ledger = gateway.ledger
    return 0 if ledger is None or ledger.durability == "lease" else ledger.commits


async def gateway_request(
    gateway: Gateway, key: str, n: int, prompt: int, steps: int
) -> float | str:
    """admit, `steps` one-token on_delta calls, release: seconds, or the refusal's reason."""
    call = Call(f"req_{n}", "anthropic", "127.0.0.1", "1.1")
    gateway.authenticate(call, key)
    start = time.perf_counter()
    try:
        await gateway.admit(call, prompt, steps)
        for _ in range(steps):
            gateway.on_delta(call, 1, 0, time.monotonic())
    except GatewayError as exc:
        return exc.reason
    finally:
        gateway.release(call)
    return time.perf_counter() - start


async def warm_up(mode: InprocMode, args: argparse.Namespace, seconds: float) -> int:
    """Requests until `seconds` passed and the last 200 in a row were admitted."""
    deadline, streak, n = time.monotonic() + seconds, 0, 0
    while time.monotonic() < deadline or streak < 200:
        n += 1
        done = await gateway_request(mode.gateway, mode.key, n, args.prompt_tokens, args.steps)
        if isinstance(done, str):
            streak = 0
            await asyncio.sleep(0.02)
        else:
            streak += 1
    return n


async def timed_round(mode: InprocMode, args: argparse.Namespace, first: int) -> None:
    tx0, commits0 = keeper_transactions(mode.gateway), ledger_commits(mode.gateway)
    for n in range(first, first + args.inproc_requests):
        done = await gateway_request(mode.gateway, mode.key, n, args.prompt_tokens, args.steps)
        if isinstance(done, str):
            mode.refused[done] += 1
        else:
            mode.seconds.append(done)
    await asyncio.sleep(0)
    mode.store_transactions += keeper_transactions(mode.gateway) - tx0
    mode.sqlite_commits += ledger_commits(mode.gateway) - commits0


def inproc_keys(url: str, sqlite_path: Path) -> dict[str, str]:
    """A budgeted key in PostgreSQL and in SQLite, and an unbudgeted one in PostgreSQL."""
    pg = PostgresStore(url)
    try:
        pg.upsert_tenant(Tenant("hot", budget=Budget(BIG_BUDGET)))
        pg_key, _ = pg.create_key("hot", budget=Budget(BIG_BUDGET))
        none_key, _ = pg.create_key("free")
    finally:
        pg.close()
    store = KeyStore(sqlite_path)
    try:
        store.upsert_tenant(Tenant("hot", budget=Budget(BIG_BUDGET)))
        sqlite_key, _ = store.create_key("hot", budget=Budget(BIG_BUDGET))
    finally:
        store.close()
    return {"pg_lease": pg_key, "sqlite": sqlite_key, "none": none_key}


async def inproc(url: str, sqlite_path: Path, args: argparse.Namespace) -> dict:
    keys = inproc_keys(url, sqlite_path)
    pg = Gateway.from_store(StoreSpec.parse(url), leases=LeaseOptions())
    sq = Gateway.from_store(sqlite_path)
    modes = [
        InprocMode("pg_lease", pg, keys["pg_lease"]),
        InprocMode("sqlite", sq, keys["sqlite"]),
        InprocMode("none", pg, keys["none"]),
    ]
    started = time.monotonic()
    try:
        for gateway in (pg, sq):
            gateway.start()
            gateway.start_watching()
        warm = {m.name: await warm_up(m, args, 0.5 if args.quick else 1.5) for m in modes}
        first = 10**6
        for round_ in range(args.inproc_rounds):
            order = modes[round_ % len(modes) :] + modes[: round_ % len(modes)]
            for mode in order:
                await timed_round(mode, args, first)
                first += args.inproc_requests
        keeper = keeper_totals(pg, time.monotonic() - started, modes, warm)
    finally:
        await pg.close()
        await sq.close()
    return summarize_inproc(modes, warm, args) | {"keeper_whole_run": keeper}


def keeper_totals(
    gateway: Gateway, seconds: float, modes: list[InprocMode], warm: dict[str, int]
) -> dict:
    """The lease keeper's transactions over the whole in-process run, warm-ups included:
    what the PostgreSQL gateway's requests (budgeted and not) cost the store."""
    stats = gateway.ledger.keeper.stats  # type: ignore[union-attr]
    requests = sum(
        warm[m.name] + len(m.seconds) + sum(m.refused.values())
        for m in modes
        if m.gateway is gateway
    )
    transactions = sum(stats.latency.counts)
    return {
        "seconds": seconds,
        "requests": requests,
        "transactions": transactions,
        "transactions_per_request": transactions / requests if requests else None,
        "transactions_per_s": transactions / seconds,
        "lease_top_ups": dict(stats.renewals),
        "mean_transaction_ms": 1000 * stats.latency.total / transactions if transactions else None,
    }


def summarize_inproc(
    modes: list[InprocMode], warm: dict[str, int], args: argparse.Namespace
) -> dict:
    rows = {}
    for m in modes:
        n = len(m.seconds) + sum(m.refused.values())
        us = [1e6 * s for s in m.seconds]
        rows[m.name] = {
            "requests": n,
            "refused": dict(m.refused),
            "warm_up_requests": warm[m.name],
            "p50_us": median(us),
            "p99_us": percentile(us, 0.99),
            "mean_us": statistics.fmean(us) if us else None,
            "pg_transactions_per_request": m.store_transactions / n if n else None,
            "pg_transactions": m.store_transactions,
            "sqlite_commits_per_request": m.sqlite_commits / n if n else None,
        }
    p50 = {name: row["p50_us"] for name, row in rows.items()}
    return {
        "what": f"admit (prompt {args.prompt_tokens}, max_tokens {args.steps}) + {args.steps}"
        " x on_delta(1 token) + release, concurrency 1, uvloop",
        "modes": rows,
        "pg_minus_none_p50_us": diff(p50["pg_lease"], p50["none"]),
        "pg_minus_sqlite_p50_us": diff(p50["pg_lease"], p50["sqlite"]),
        "pg_minus_none_p99_us": diff(rows["pg_lease"]["p99_us"], rows["none"]["p99_us"]),
        "target_added_p50_us": 1000 * ADDED_TARGET_MS,
    }


def run_uvloop(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def print_inproc(r: dict) -> None:
    print(f"\n== 1a. in-process gateway, per request: {r['what']}")
    rows = [
        [
            name, m["requests"], sum(m["refused"].values()), m["p50_us"], m["p99_us"],
            m["mean_us"], m["pg_transactions_per_request"], m["sqlite_commits_per_request"],
        ]
        for name, m in r["modes"].items()
    ]  # fmt: skip
    headers = [
        "mode", "requests", "refused", "p50 us", "p99 us", "mean us", "PG tx/req (timed)",
        "SQLite commits/req",
    ]  # fmt: skip
    print_table(headers, rows)
    k = r["keeper_whole_run"]
    print(
        f"  the lease keeper over the whole in-process run ({k['seconds']:.1f} s, warm-ups"
        f" included): {k['transactions']} PostgreSQL transactions for {k['requests']} requests"
        f" ({fmt(k['transactions_per_request'], '.2g')} per request; lease top-ups"
        f" {k['lease_top_ups']}; mean {fmt(k['mean_transaction_ms'], '.2f')} ms each); a"
        " request waits for one only when its lease cannot cover it"
    )
    print(
        f"  pg_lease - none: p50 {fmt(r['pg_minus_none_p50_us'], '+.1f')} us"
        f" (target < {r['target_added_p50_us']:.0f} us), p99"
        f" {fmt(r['pg_minus_none_p99_us'], '+.1f')} us; pg_lease - sqlite: p50"
        f" {fmt(r['pg_minus_sqlite_p50_us'], '+.1f')} us"
    )
