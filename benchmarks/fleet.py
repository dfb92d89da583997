"""A fleet on one shared store (`zerohop serve --store postgresql://...`), side by side in one
run: what the shared store adds per request, how much of a budget the fleet can use, and how
far its rate limits overshoot. A real PostgreSQL (tests/postgres_server.py: its own temporary
cluster, fsync on) and real `zerohop serve` replicas of the default model (SmolLM2-135M), each
started one after another with an XDG_DATA_HOME of its own, `--num-threads 1` and
OMP_NUM_THREADS=1, on ports it binds itself (tests/live_server.py). Six replicas in all:
  fleet0..2  `--store` on one PostgreSQL database (ZEROHOP_STORE): keys, budget leases and
             rate shares shared;
  solo0..2   each on a SQLite store of its own (a copy of one file, so the same key secrets
             work on all three), each enforcing its budgets and limits alone; solo0 is also
             "the plain replica" (`--keys-db`) of parts 1b and 3.

1. Added latency per request from the shared store (target: p50 < 0.1 ms).
   (a) In this process, on uvloop, concurrency 1: `Gateway.admit` of a request whose key
       and tenant both have a budget (--prompt-tokens 128, max_tokens --steps 64), --steps
       `on_delta` calls of one token, `release`; per request, the wall time of those calls.
       Three modes, in alternating rounds: "pg_lease"
       (`Gateway.from_store(StoreSpec.parse(url))`, its leases warmed up first), "sqlite"
       (`Gateway.from_store(path)`: admission awaits the ledger's durable local commit, fsync
       included), "none" (the pg_lease gateway, a key and tenant without a budget). p50 / p99
       per request, pg_lease - none and pg_lease - sqlite at p50; the PG transactions per
       request (the lease keeper's `stats.latency` count: lease changes, heartbeats, sweeps;
       in the timed rounds and over the whole run) and SQLite commits per request.
   (b) Served: TTFT p50 at concurrency 1 (streamed Messages, the first content_block_delta,
       max_tokens 2, prompts of their own) on fleet0 against solo0, both with a budgeted key,
       and on fleet0 with an unbudgeted key, in rounds of one request each (the order
       rotating: rounds of ten let the machine's drift show as a few % either way); the
       ratio fleet0 / solo0, client-side and by the audit records' ttft_s.
2. Usable budget (target >= 95%): a tenant with --budget B tokens (total), --streams (48)
   workers through `zerohop.client` (ReplicaPool over fleet0..2, the anthropic SDK,
   max_tokens 16, "count to N" as tests/test_fleet_store.py) until every one is refused 429
   insufficient_quota; 529/503 (budget_lease_unavailable, overloaded) are retried after the
   answer's retry-after-ms, as the official SDKs do (--retry-sleep S: a fixed wait instead).
   Tokens served (the clients' usage: input + output) / B, the fleet's settled (and settled +
   leased) at the first refusal / B, and `settled + leased <= B` sampled from PostgreSQL
   every 100 ms (the largest seen), with what each active lease holds (`leases`) at every
   change; answers, retries and refusals per 10 s; the longest time without an answer; the
   lease keepers' PostgreSQL transactions (GET /metrics) per HTTP request.
   Contrast: the same over solo0..2, each with the budget --contrast-budget Bc (B/4) of its
   own: what they serve / Bc (up to 3x).
3. Worst rate overshoot: a tenant with --rpm L and no budget, offered 3 L per minute
   (evenly spaced, max_tokens 1, plain httpx: no failover, so where it goes is where it is
   sent) for --cycles cycles of three --phase-seconds phases: all to fleet0, all to fleet1,
   round robin over all three; the same arrivals go, at the same moments, to solo0 alone
   (one replica holding the whole limit). Admission times are the replicas' audit records
   (`time` = arrival, decision admitted) of that tenant; for T in 1, 10, 60 s the largest
   A(T) over sliding windows and the overshoot (A(T) - (L + L*T/60)) / L (<= 0: inside
   fleet_rates' bound); the client's own 200s are counted too, and each fleet replica's
   share (`rate_shares`) is sampled every 0.5 s.

    .venv/bin/python benchmarks/fleet.py            # ~8-10 minutes on 2 cores
    .venv/bin/python benchmarks/fleet.py --quick    # a short run: smaller budgets, phases

Prints the figures and writes bench-results/fleet.json (--out); the replicas' logs are
copied to bench-results/fleet-NAME.log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import anthropic
import httpx
import psycopg
from _common import ROOT, cpu_count, print_table, write_json

from tests.live_server import LiveServer
from tests.pg_fixtures import fresh_database
from tests.postgres_server import PostgresServer, require_postgres
from zerohop.client import ReplicaPool, async_http_client
from zerohop.gateway.fleet_options import LeaseOptions
from zerohop.gateway.gateway import Call, Gateway, GatewayError
from zerohop.gateway.keys.identity import Budget, Limits, Tenant
from zerohop.gateway.store.pg_migrations import migrate
from zerohop.gateway.store.postgres import PostgresStore
from zerohop.gateway.store.spec import STORE_ENV, StoreSpec
from zerohop.gateway.store.sqlite import KeyStore

MODEL = "fleet-bench"
OUT = ROOT / "bench-results" / "fleet.json"
ADDED_TARGET_MS = 0.1  # pg_lease - none, p50 per request
USABLE_TARGET = 0.95  # tokens served / budget
WINDOWS = (1.0, 10.0, 60.0)  # seconds, of the rate overshoot
RETRY_SLEEP = 0.2  # seconds before a 529/503 without retry-after is retried
RETRY_CAP = 5.0  # seconds: the most a retry-after is waited
SAMPLE_EVERY = 0.1  # seconds between budget_state samples
SPEND_MAX_TOKENS = 16
SPEND_DEADLINE = 600.0  # seconds: a safety net only (every stream should be refused)
BIG_BUDGET = 10**12  # never refuses (part 1)
TTFT_BUDGET = 10**9


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a short run (smaller everything)")
    p.add_argument("--budget", type=int, help="B of part 2 (default 20000; quick 6000)")
    p.add_argument("--contrast-budget", type=int, help="each SQLite replica's budget (default B/4)")
    p.add_argument("--streams", type=int, default=48, help="concurrent workers of part 2")
    p.add_argument(
        "--retry-sleep", type=float, default=None,
        help="seconds part 2 waits before retrying a 529/503 (default: the answer's"
        " retry-after-ms / retry-after, as the official SDKs do; tests/test_fleet_store.py"
        " waits 0.2)",
    )  # fmt: skip
    p.add_argument("--rpm", type=int, default=120, help="L of part 3")
    p.add_argument("--phase-seconds", type=float, help="part 3's phases (default 20; quick 5)")
    p.add_argument("--cycles", type=int, help="of part 3's three phases (default 2; quick 1)")
    p.add_argument("--inproc-requests", type=int, help="per mode and round (1000; quick 300)")
    p.add_argument("--inproc-rounds", type=int, help="of part 1a (default 5; quick 2)")
    p.add_argument("--ttft-requests", type=int, help="per replica and round (default 1)")
    p.add_argument("--ttft-rounds", type=int, help="of part 1b (default 60; quick 8)")
    p.add_argument("--steps", type=int, default=64, help="on_delta calls per request (1a)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="of part 1a's requests")
    p.add_argument("--dir", type=Path, default=ROOT / "bench-results", help="work folder")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {
        "budget": 6000 if quick else 20_000,
        "phase_seconds": 5.0 if quick else 20.0,
        "cycles": 1 if quick else 2,
        "inproc_requests": 300 if quick else 1000,
        "inproc_rounds": 2 if quick else 5,
        "ttft_requests": 1,
        "ttft_rounds": 8 if quick else 60,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.contrast_budget = args.contrast_budget or args.budget // 4
    return args


# -- figures ----------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


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


# -- the replicas -----------------------------------------------------------------------------


@dataclass(slots=True)
class Fleet:
    url: str  # the shared store's database
    fleet: list[LiveServer]
    solo: list[LiveServer]
    keys: dict[str, str]  # purpose -> secret in PostgreSQL; "solo_" + purpose: in the copies
    folders: dict[str, Path]


def fleet_keys(url: str, args: argparse.Namespace) -> dict[str, str]:
    store = PostgresStore(url)
    try:
        return make_keys(store, args.budget, args.rpm)
    finally:
        store.close()


def make_keys(store: Any, budget: int, rpm: int) -> dict[str, str]:
    """The tenants the served parts use, and a key of each (no limits of its own)."""
    store.upsert_tenant(Tenant("usable", budget=Budget(budget)))
    store.upsert_tenant(Tenant("ttft", budget=Budget(TTFT_BUDGET)))
    store.upsert_tenant(Tenant("rated", limits=Limits(rpm=rpm)))
    store.upsert_tenant(Tenant("free"))  # no budget, no limits
    return {name: store.create_key(name)[0] for name in ("usable", "ttft", "rated", "free")}


def solo_store(path: Path, args: argparse.Namespace) -> dict[str, str]:
    """The SQLite store the solo replicas get a copy each of (B = the contrast budget)."""
    store = KeyStore(path)
    try:
        return make_keys(store, args.contrast_budget, args.rpm)
    finally:
        store.close()


def copy_store(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    source, target = sqlite3.connect(src), sqlite3.connect(dst)
    try:
        source.backup(target)
    finally:
        source.close()
        target.close()


def start_replica(stack: contextlib.ExitStack, folder: Path, env: dict[str, str]) -> LiveServer:
    server = LiveServer(None, [], served_model_name=MODEL, extra_env=env)
    stack.callback(server.stop)  # before start: an interrupted start is stopped too
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    server.start(folder / "server.log", timeout=300)
    print(f"  {folder.name}: {server.url} ready in {time.monotonic() - started:.1f}s", flush=True)
    return server


def start_all(
    stack: contextlib.ExitStack, pg: PostgresServer, work: Path, args: argparse.Namespace
) -> Fleet:
    url = fresh_database(pg)
    migrate(url)
    keys = fleet_keys(url, args)
    template = work / "solo-template.db"
    solo_keys = solo_store(template, args)
    folders: dict[str, Path] = {}
    fleet, solo = [], []
    print("starting 6 replicas, one after another", flush=True)
    for i in range(3):
        folders[f"fleet{i}"] = work / f"fleet{i}"
        fleet.append(start_replica(stack, folders[f"fleet{i}"], {STORE_ENV: url}))
    for i in range(3):
        folder = folders[f"solo{i}"] = work / f"solo{i}"
        copy_store(template, folder / "data" / "zerohop" / "keys.db")
        solo.append(start_replica(stack, folder, {}))
    keys |= {f"solo_{name}": secret for name, secret in solo_keys.items()}
    return Fleet(url, fleet, solo, keys, folders)


# -- 1b: served TTFT --------------------------------------------------------------------------


async def ttft_once(client: anthropic.AsyncAnthropic, n: int) -> float | None:
    start = time.perf_counter()
    first = None
    async with client.messages.stream(
        model=MODEL,
        max_tokens=2,
        messages=[{"role": "user", "content": f"Note {n:06d}: say hello."}],
        extra_body={"temperature": 0},
    ) as stream:
        async for event in stream:
            if event.type == "content_block_delta" and first is None:
                first = time.perf_counter() - start
    return first


async def served_ttft(f: Fleet, args: argparse.Namespace) -> dict:
    clients = {
        "store": anthropic.AsyncAnthropic(
            base_url=f.fleet[0].url, api_key=f.keys["ttft"], max_retries=0
        ),
        "store_unbudgeted": anthropic.AsyncAnthropic(
            base_url=f.fleet[0].url, api_key=f.keys["free"], max_retries=0
        ),
        "plain": anthropic.AsyncAnthropic(
            base_url=f.solo[0].url, api_key=f.keys["solo_ttft"], max_retries=0
        ),
    }
    seconds: dict[str, list[float]] = {name: [] for name in clients}
    n = 0
    try:
        for client in clients.values():  # warm-up: the model's first steps, the lease
            for _ in range(3):
                n += 1
                await ttft_once(client, n)
        timed_from = time.time()
        for round_ in range(args.ttft_rounds):
            names = list(clients)
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                for _ in range(args.ttft_requests):
                    n += 1
                    if (ttft := await ttft_once(clients[name], n)) is not None:
                        seconds[name].append(ttft)
    finally:
        for client in clients.values():
            await client.close()
    ms = {name: [1000 * s for s in values] for name, values in seconds.items()}
    p50 = {name: median(values) for name, values in ms.items()}
    await asyncio.sleep(1.0)  # the audit logs' last flush (every 0.2 s)
    server = server_ttft(f, timed_from)
    return {
        "server_ttft_p50_ms": server,
        "server_store_over_plain_p50": ratio(server["store"], server["plain"]),
        "what": "streamed Messages, concurrency 1, max_tokens 2: until the first"
        " content_block_delta; store = fleet0 (--store), store_unbudgeted = fleet0 with a key"
        " without a budget, plain = solo0 (--keys-db)",
        "ttft_p50_ms": p50,
        "ttft_p90_ms": {name: percentile(values, 0.9) for name, values in ms.items()},
        "requests": {name: len(values) for name, values in ms.items()},
        "store_over_plain_p50": ratio(p50["store"], p50["plain"]),
        "store_over_store_unbudgeted_p50": ratio(p50["store"], p50["store_unbudgeted"]),
        "ttft_ms": ms,
    }


def server_ttft(f: Fleet, since: float) -> dict[str, float | None]:
    """TTFT p50 as the replicas' audit records have it (`ttft_s`: from arrival), ms."""
    where = {
        "store": (f.folders["fleet0"], "ttft"),
        "store_unbudgeted": (f.folders["fleet0"], "free"),
        "plain": (f.folders["solo0"], "ttft"),
    }
    out = {}
    for name, (folder, tenant) in where.items():
        values = [
            1000 * r["ttft_s"]
            for r in audit_records(folder)
            if r.get("tenant") == tenant and r.get("ttft_s") is not None
            and record_time(r) >= since
        ]  # fmt: skip
        out[name] = median(values)
    return out


# -- 2: usable budget -------------------------------------------------------------------------


def budget_state(url: str, subject: str) -> tuple[int, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT settled, leased FROM budget_state WHERE subject = %s", (subject,)
        ).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


class Sampler:
    """settled and leased of one subject every SAMPLE_EVERY seconds, from a thread."""

    def __init__(self, url: str, subject: str, budget: int) -> None:
        self.url, self.subject, self.budget = url, subject, budget
        self.samples = 0
        self.max_charged = 0  # settled + leased
        self.violations = 0  # samples with settled + leased > budget
        self.errors = 0
        self.leases: list[tuple[float, int, int, list[int]]] = []  # on change: see _held
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="budget-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _held(self, conn: psycopg.Connection, settled: int, leased: int) -> None:
        """(s, settled, leased, what each active lease holds unreported), when it changes."""
        rows = conn.execute(
            "SELECT granted - settled FROM leases WHERE subject = %s AND state = 'active'"
            " ORDER BY replica_id",
            (self.subject,),
        ).fetchall()
        held = [int(r[0]) for r in rows]
        if not self.leases or self.leases[-1][1:] != (settled, leased, held):
            self.leases.append((time.monotonic() - self._started, settled, leased, held))

    def _run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._stop.wait(SAMPLE_EVERY):
                try:
                    row = conn.execute(
                        "SELECT settled, leased FROM budget_state WHERE subject = %s",
                        (self.subject,),
                    ).fetchone()
                except psycopg.Error:
                    self.errors += 1
                    continue
                charged = 0 if row is None else int(row[0]) + int(row[1])
                if row is not None:
                    self._held(conn, int(row[0]), int(row[1]))
                self.samples += 1
                self.max_charged = max(self.max_charged, charged)
                self.violations += charged > self.budget


@dataclass(slots=True)
class Tally:
    started: float = field(default_factory=time.monotonic)
    tokens: int = 0
    answers: int = 0
    exhausted: int = 0
    retried: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    first_refusal_s: float | None = None
    refusal_message: str | None = None
    last_refusal_s: float | None = None
    first_refusal_state: tuple[int, int] | None = None
    events: list[tuple[float, str, int]] = field(default_factory=list)  # (s, kind, tokens)

    def note(self, kind: str, tokens: int = 0) -> None:
        self.events.append((time.monotonic() - self.started, kind, tokens))


def is_budget_refusal(exc: anthropic.APIStatusError) -> bool:
    return exc.status_code == 429 and "budget" in str(exc.message)


def retry_wait(exc: anthropic.APIStatusError, fixed: float | None) -> float:
    """What the official SDKs wait: retry-after-ms, else retry-after (capped)."""
    if fixed is not None:
        return fixed
    headers = exc.response.headers
    with contextlib.suppress(TypeError, ValueError):
        if (ms := headers.get("retry-after-ms")) is not None:
            return min(RETRY_CAP, float(ms) / 1000)
        if (seconds := headers.get("retry-after")) is not None:
            return min(RETRY_CAP, float(seconds))
    return RETRY_SLEEP


def retry_reason(exc: anthropic.APIStatusError) -> str:
    text = str(exc.message)
    if "share of the token budget" in text:
        return f"{exc.status_code} budget_lease_unavailable"
    return f"{exc.status_code} other"


async def spend_worker(
    client: anthropic.AsyncAnthropic,
    n: int,
    tally: Tally,
    on_refused: Callable[[], Any],
    deadline: float,
    retry_sleep: float | None,
) -> None:
    """Requests until this worker is refused as over budget (or the deadline passes)."""
    while time.monotonic() < deadline:
        try:
            message = await client.messages.create(
                model=MODEL,
                max_tokens=SPEND_MAX_TOKENS,
                extra_body={"temperature": 0},
                messages=[{"role": "user", "content": f"count to {n}"}],
            )
        except anthropic.APIStatusError as exc:
            if is_budget_refusal(exc):
                tally.exhausted += 1
                tally.refusal_message = tally.refusal_message or str(exc.message)
                tally.note("refused")
                await on_refused()
                return
            if exc.status_code in (503, 529):
                tally.retried[retry_reason(exc)] += 1
                tally.note("retried")
                await asyncio.sleep(retry_wait(exc, retry_sleep))
                continue
            tally.errors[f"{exc.status_code} {exc.message}"[:120]] += 1
            await asyncio.sleep(RETRY_SLEEP)
            continue
        except anthropic.APIConnectionError as exc:
            tally.errors[type(exc).__name__] += 1
            await asyncio.sleep(RETRY_SLEEP)
            continue
        tokens = message.usage.input_tokens + message.usage.output_tokens
        tally.answers += 1
        tally.tokens += tokens
        tally.note("answer", tokens)


async def spend_budget(
    urls: list[str], key: str, args: argparse.Namespace, url: str | None
) -> tuple[Tally, dict]:
    """`streams` workers over `urls` through zerohop.client until each is refused."""
    pool = ReplicaPool(urls)
    client = anthropic.AsyncAnthropic(
        base_url="http://zerohop",  # a name only: the pool chooses the replica
        api_key=key,
        max_retries=0,
        http_client=async_http_client(pool=pool),
    )
    tally = Tally()

    async def on_refused() -> None:
        now = time.monotonic() - tally.started
        tally.last_refusal_s = now
        if tally.first_refusal_s is None:
            tally.first_refusal_s = now
            if url is not None:
                tally.first_refusal_state = await asyncio.to_thread(
                    budget_state, url, "tenant:usable"
                )

    deadline = time.monotonic() + SPEND_DEADLINE
    workers = (
        spend_worker(client, n, tally, on_refused, deadline, args.retry_sleep)
        for n in range(args.streams)
    )
    try:
        await asyncio.gather(*workers)
    finally:
        await client.close()
        stats = pool.stats()
        pool.close()
    return tally, stats


def timeline(tally: Tally, step: float) -> list[dict]:
    """Per `step` seconds: answers, their tokens, 529/503 retries, budget refusals."""
    bins: dict[int, Counter] = {}
    for at, kind, tokens in tally.events:
        counts = bins.setdefault(int(at // step), Counter())
        counts[kind] += 1
        counts["tokens"] += tokens
    last = max(bins, default=-1)
    return [{"from_s": i * step, **bins.get(i, Counter())} for i in range(last + 1)]


def gaps(tally: Tally) -> list[tuple[float, float]]:
    """(seconds, from s) of each time without an answer, until the last refusal."""
    end = tally.last_refusal_s or 0.0
    answers = [at for at, kind, _ in tally.events if kind == "answer"]
    marks = [0.0, *answers, end]
    return [(b - a, a) for a, b in itertools.pairwise(marks)]


def tally_figures(tally: Tally, budget: int, stats: dict, streams: int) -> dict:
    spans = gaps(tally)
    stall, stall_from = max(spans, default=(0.0, 0.0))
    return {
        "budget": budget,
        "streams": streams,
        "tokens_served": tally.tokens,
        "served_over_budget": tally.tokens / budget,
        "answers": tally.answers,
        "refused_insufficient_quota": tally.exhausted,
        "every_stream_refused": tally.exhausted == streams,
        "retried": dict(tally.retried),
        "errors": dict(tally.errors),
        "first_refusal_s": tally.first_refusal_s,
        "refusal_message": tally.refusal_message,
        "last_refusal_s": tally.last_refusal_s,
        "requests_per_replica": {u: s.get("requests", 0) for u, s in stats.items()},
        "failovers": sum(s.get("failovers", 0) for s in stats.values()),
        "longest_stall_s": stall,
        "longest_stall_from_s": stall_from,
        "stalls_over_5s": [{"seconds": g, "from_s": at} for g, at in spans if g > 5.0],
        "timeline_10s": timeline(tally, 10.0),
    }


STORE_SERIES = (
    "zerohop_store_latency_seconds_count",
    "zerohop_store_latency_seconds_sum",
    'zerohop_budget_lease_renewals_total{result="full"}',
    'zerohop_budget_lease_renewals_total{result="partial"}',
    'zerohop_budget_lease_renewals_total{result="none"}',
)


def store_counters(servers: Sequence[LiveServer]) -> dict[str, float]:
    """The fleet's lease-keeper counters, summed over `servers` (GET /metrics)."""
    totals = dict.fromkeys(STORE_SERIES, 0.0)
    for server in servers:
        for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
            name, _, value = line.rpartition(" ")
            if name in totals:
                totals[name] += float(value)
    return totals


def store_work(before: dict[str, float], after: dict[str, float], requests: int) -> dict:
    delta = {name: after[name] - before[name] for name in STORE_SERIES}
    count = delta["zerohop_store_latency_seconds_count"]
    return {
        "http_requests": requests,
        "transactions": int(count),
        "transactions_per_http_request": count / requests if requests else None,
        "lease_top_ups": int(sum(v for k, v in delta.items() if "renewals" in k)),
        "mean_transaction_ms": 1000 * delta["zerohop_store_latency_seconds_sum"] / count
        if count
        else None,
    }


def usable_fleet(f: Fleet, args: argparse.Namespace) -> dict:
    budget = args.budget
    counters = store_counters(f.fleet)
    with Sampler(f.url, "tenant:usable", budget) as sampler:
        tally, stats = asyncio.run(
            spend_budget([s.url for s in f.fleet], f.keys["usable"], args, f.url)
        )
        at_end = budget_state(f.url, "tenant:usable")
        time.sleep(6.0)  # every replica reports its spend within 5 s
    later = budget_state(f.url, "tenant:usable")
    out = tally_figures(tally, budget, stats, args.streams)
    requests = sum(out["requests_per_replica"].values())
    first = tally.first_refusal_state or (0, 0)
    out |= {
        "store_work": store_work(counters, store_counters(f.fleet), requests),
        "settled_at_first_refusal": first[0],
        "leased_at_first_refusal": first[1],
        "settled_at_first_refusal_over_budget": first[0] / budget,
        "charged_at_first_refusal_over_budget": sum(first) / budget,
        "settled_leased_at_end": at_end,
        "settled_leased_6s_later": later,
        "settled_6s_later_over_budget": later[0] / budget,
        "samples": sampler.samples,
        "max_settled_plus_leased": sampler.max_charged,
        "max_settled_plus_leased_over_budget": sampler.max_charged / budget,
        "samples_over_budget": sampler.violations,
        "sample_errors": sampler.errors,
        "lease_changes": [
            {"at_s": at, "settled": st, "leased": le, "held_per_lease": held}
            for at, st, le, held in sampler.leases
        ],
        "target_served_over_budget": USABLE_TARGET,
    }
    return out


def solo_spend(folder: Path) -> int:
    """Tokens the solo replica's own ledger charged the usable tenant."""
    store = KeyStore(folder / "data" / "zerohop" / "keys.db")
    try:
        return sum(t for s, _, t in store.spend() if s == "tenant:usable")
    finally:
        store.close()


def usable_solo(f: Fleet, args: argparse.Namespace) -> dict:
    budget = args.contrast_budget
    urls = [s.url for s in f.solo]
    tally, stats = asyncio.run(spend_budget(urls, f.keys["solo_usable"], args, None))
    spends = [solo_spend(f.folders[f"solo{i}"]) for i in range(3)]
    return tally_figures(tally, budget, stats, args.streams) | {
        "ledger_spend_per_replica": spends,
        "ledger_spend_over_budget": sum(spends) / budget,
    }


# -- 3: rate overshoot ------------------------------------------------------------------------


def phase_plan(args: argparse.Namespace) -> list[list[int]]:
    """Which fleet replicas each phase sends to: fleet0, fleet1, then all three."""
    return [[0], [1], [0, 1, 2]] * args.cycles


async def rated_request(
    http: httpx.AsyncClient, url: str, key: str, n: int, log: list[tuple[float, int]]
) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 1,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"ping {n}"}],
    }
    sent = time.time()
    try:
        response = await http.post(url + "/v1/messages", json=body, headers={"x-api-key": key})
        log.append((sent, response.status_code))
    except httpx.HTTPError:
        log.append((sent, -1))


async def offer_load(
    f: Fleet, args: argparse.Namespace
) -> tuple[float, dict[str, list[tuple[float, int]]]]:
    """3 L per minute, evenly spaced, to the fleet (by phase) and to solo0, at once."""
    interval = 60.0 / (3 * args.rpm)
    plan = phase_plan(args)
    logs: dict[str, list[tuple[float, int]]] = {"fleet": [], "single": []}
    tasks = []
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        start, start_wall = time.monotonic(), time.time()
        n = 0
        for phase, targets in enumerate(plan):
            end = (phase + 1) * args.phase_seconds
            while (at := n * interval) < end:
                await asyncio.sleep(max(0.0, start + at - time.monotonic()))
                replica = f.fleet[targets[n % len(targets)]]
                sends = (
                    (replica.url, f.keys["rated"], logs["fleet"]),
                    (f.solo[0].url, f.keys["solo_rated"], logs["single"]),
                )
                for url, key, log in sends:
                    tasks.append(asyncio.ensure_future(rated_request(http, url, key, n, log)))
                n += 1
        await asyncio.gather(*tasks)
    return start_wall, logs


def audit_records(folder: Path) -> Iterator[dict]:
    """Every record of a replica's audit log (rotated files first, as they chain)."""
    import orjson

    audit = folder / "data" / "zerohop" / "audit"
    for path in sorted(audit.glob("audit*.jsonl"), key=lambda p: (p.name == "audit.jsonl", p)):
        for line in path.read_bytes().splitlines():
            with contextlib.suppress(orjson.JSONDecodeError):  # a torn tail
                yield orjson.loads(line)


def record_time(record: dict) -> float:
    return datetime.fromisoformat(record["time"]).timestamp()


def audit_admissions(folder: Path, tenant: str) -> list[float]:
    """Arrival times (unix s) of the tenant's admitted requests in a replica's audit log."""
    return [
        record_time(r)
        for r in audit_records(folder)
        if r.get("tenant") == tenant and r.get("decision") in ("admitted", "clamped")
    ]


def worst_window(times: Sequence[float], window: float) -> int:
    """The most admissions in any closed interval `window` seconds long."""
    ordered = sorted(times)
    best, j = 0, 0
    for i, t in enumerate(ordered):
        while ordered[j] < t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


def overshoot(times: Sequence[float], rpm: int) -> dict[str, dict]:
    out = {}
    for window in WINDOWS:
        bound = rpm + rpm * window / 60.0
        worst = worst_window(times, window)
        out[f"{window:g}"] = {
            "bound": bound,
            "worst_admitted": worst,
            "overshoot_over_L": (worst - bound) / rpm,
        }
    return out


class SharePoller:
    """The fleet's rate shares of one subject (PostgreSQL's rate_shares) every 0.5 s from a
    thread, kept each time they change: (s, {replica: share})."""

    def __init__(self, url: str, subject: str, names: dict[str, str]) -> None:
        self.url, self.subject, self.names = url, subject, names  # pid -> replica name
        self.changes: list[tuple[float, dict[str, float]]] = []
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="share-poller", daemon=True)

    def __enter__(self) -> SharePoller:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _name(self, replica_id: str) -> str:
        parts = replica_id.rsplit("-", 2)  # host-pid-hex (lease_keeper.new_replica_id)
        return self.names.get(parts[1], replica_id) if len(parts) == 3 else replica_id

    def _run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._stop.wait(0.5):
                with contextlib.suppress(psycopg.Error):
                    rows = conn.execute(
                        "SELECT replica_id, share FROM rate_shares WHERE subject = %s"
                        " AND expires_at > now()",
                        (self.subject,),
                    ).fetchall()
                    shares = {self._name(r): round(float(v), 3) for r, v in sorted(rows)}
                    if not self.changes or self.changes[-1][1] != shares:
                        self.changes.append((time.monotonic() - self.started, shares))


def per_phase(times: Sequence[float], start: float, args: argparse.Namespace) -> list[int]:
    counts = [0] * len(phase_plan(args))
    for t in times:
        phase = int((t - start) // args.phase_seconds)
        if 0 <= phase < len(counts):
            counts[phase] += 1
    return counts


def rate_overshoot(f: Fleet, args: argparse.Namespace) -> dict:
    started = time.time() - 1.0  # audit records of this part only (other tenants aside)
    names = {str(server.process.pid): f"fleet{i}" for i, server in enumerate(f.fleet)}
    with SharePoller(f.url, "tenant:rated", names) as shares:
        load_start, logs = asyncio.run(offer_load(f, args))
    time.sleep(1.0)  # the audit logs' last flush (every 0.2 s)
    per_replica = [
        [t for t in audit_admissions(f.folders[f"fleet{i}"], "rated") if t >= started]
        for i in range(3)
    ]
    fleet_times = [t for times in per_replica for t in times]
    single_times = [t for t in audit_admissions(f.folders["solo0"], "rated") if t >= started]
    client = {name: [t for t, status in log if status == 200] for name, log in logs.items()}
    statuses = {name: dict(Counter(s for _, s in log)) for name, log in logs.items()}
    return {
        "L_rpm": args.rpm,
        "offered_per_minute": 3 * args.rpm,
        "phases": [[f"fleet{i}" for i in p] for p in phase_plan(args)],
        "phase_seconds": args.phase_seconds,
        "duration_s": len(phase_plan(args)) * args.phase_seconds,
        "statuses": statuses,
        "admitted": {"fleet": len(fleet_times), "single": len(single_times)},
        "fleet_admitted_per_replica": [len(times) for times in per_replica],
        "admitted_per_phase": {
            "fleet": per_phase(fleet_times, load_start, args),
            "single": per_phase(single_times, load_start, args),
            "fleet_per_replica": [per_phase(t, load_start, args) for t in per_replica],
        },
        "audit": {
            "fleet": overshoot(fleet_times, args.rpm),
            "single": overshoot(single_times, args.rpm),
        },
        "client_200s": {name: overshoot(times, args.rpm) for name, times in client.items()},
        "share_changes": [{"at_s": at, "shares": v} for at, v in shares.changes],
        "shares_by_second": shares_by_second(shares.changes, len(phase_plan(args)), args),
    }


def shares_by_second(
    changes: list[tuple[float, dict[str, float]]], phases: int, args: argparse.Namespace
) -> dict[str, list[float]]:
    """Each fleet replica's share at every 5th second of the run (0 where it holds none)."""
    out: dict[str, list[float]] = {f"fleet{i}": [] for i in range(3)}
    for second in range(0, int(phases * args.phase_seconds) + 1, 5):
        current: dict[str, float] = {}
        for at, shares in changes:
            if at <= second:
                current = shares
        for name, values in out.items():
            values.append(current.get(name, 0.0))
    return out


# -- report -----------------------------------------------------------------------------------


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


def print_ttft(r: dict) -> None:
    p50, p90, n = r["ttft_p50_ms"], r["ttft_p90_ms"], r["requests"]
    print("\n== 1b. served TTFT, concurrency 1")
    server = r["server_ttft_p50_ms"]
    rows = [[name, n[name], p50[name], p90[name], server[name]] for name in p50]
    print_table(["replica / key", "requests", "TTFT p50 ms", "p90 ms", "audit p50 ms"], rows)
    print(
        f"  --store replica / plain --keys-db replica (budgeted keys), p50:"
        f" {fmt(r['store_over_plain_p50'])}x; --store budgeted / unbudgeted key:"
        f" {fmt(r['store_over_store_unbudgeted_p50'])}x; by the audit records' ttft_s:"
        f" store / plain {fmt(r['server_store_over_plain_p50'])}x"
    )


def print_usable(fleet: dict, solo: dict) -> None:
    print(
        f"\n== 2. usable budget, {fleet['streams']} streams through zerohop.client over 3 replicas"
    )
    print(
        f"  fleet (PostgreSQL, B {fleet['budget']}): served {fleet['tokens_served']} tokens ="
        f" {100 * fleet['served_over_budget']:.1f}% of B (target >= 95%);"
        f" settled at the first refusal {100 * fleet['settled_at_first_refusal_over_budget']:.1f}%"
        f" (settled + leased {100 * fleet['charged_at_first_refusal_over_budget']:.1f}%),"
        f" settled 6 s after the last {100 * fleet['settled_6s_later_over_budget']:.1f}%"
    )
    print(
        f"  settled + leased <= B: max {fleet['max_settled_plus_leased']}"
        f" ({100 * fleet['max_settled_plus_leased_over_budget']:.1f}% of B) over"
        f" {fleet['samples']} samples, {fleet['samples_over_budget']} over B;"
        f" {fleet['answers']} answers, refused {fleet['refused_insufficient_quota']}/"
        f"{fleet['streams']}, retried {fleet['retried']}, first refusal at"
        f" {fmt(fleet['first_refusal_s'], '.1f')} s, last {fmt(fleet['last_refusal_s'], '.1f')} s"
    )
    work = fleet["store_work"]
    print(
        f"  the fleet's lease keepers: {work['transactions']} PostgreSQL transactions for"
        f" {work['http_requests']} HTTP requests"
        f" ({fmt(work['transactions_per_http_request'], '.2f')} per request; a request waits"
        " for one only when its lease cannot cover it: once the budget runs scarce, every"
        f" time), {work['lease_top_ups']} top-ups, mean"
        f" {fmt(work['mean_transaction_ms'], '.2f')} ms"
    )
    stalls = ", ".join(
        f"{g['seconds']:.1f} s from {g['from_s']:.1f} s" for g in fleet["stalls_over_5s"]
    )
    print(
        f"  times without an answer over 5 s: fleet {stalls or 'none'}; longest for the SQLite"
        f" replicas {solo['longest_stall_s']:.1f} s; per 10 s (answers / retries): fleet"
        f" {brief_timeline(fleet)}"
    )
    print(
        f"  contrast, 3 replicas each on its own SQLite store with B {solo['budget']}: served"
        f" {solo['tokens_served']} tokens = {solo['served_over_budget']:.2f}x B (ledgers:"
        f" {solo['ledger_spend_per_replica']}, {solo['ledger_spend_over_budget']:.2f}x B);"
        f" refused {solo['refused_insufficient_quota']}/{solo['streams']}"
    )


def brief_timeline(r: dict) -> str:
    return " ".join(f"{b.get('answer', 0)}/{b.get('retried', 0)}" for b in r["timeline_10s"])


def print_rates(r: dict) -> None:
    print(
        f"\n== 3. rate overshoot: L = {r['L_rpm']} rpm, offered {r['offered_per_minute']}/min"
        f" for {r['duration_s']:.0f} s, phases of {r['phase_seconds']:g} s: {r['phases'][:3]}"
    )
    rows = []
    for window in (f"{w:g}" for w in WINDOWS):
        fleet, single = r["audit"]["fleet"][window], r["audit"]["single"][window]
        rows.append([
            window, fleet["bound"], fleet["worst_admitted"], fleet["overshoot_over_L"],
            single["worst_admitted"], single["overshoot_over_L"],
            r["client_200s"]["fleet"][window]["worst_admitted"],
        ])  # fmt: skip
    headers = [
        "T s", "L + L*T/60", "fleet A(T)", "fleet overshoot/L", "single A(T)",
        "single overshoot/L", "fleet A(T) client 200s",
    ]  # fmt: skip
    print_table(headers, rows)
    worst = max(v["overshoot_over_L"] for v in r["audit"]["fleet"].values())
    print(
        f"  admitted: fleet {r['admitted']['fleet']} (per replica"
        f" {r['fleet_admitted_per_replica']}), single {r['admitted']['single']}; worst fleet"
        f" overshoot {worst:+.3f} L ({'inside' if worst <= 0 else 'past'} the bound)"
    )
    for name, values in r["shares_by_second"].items():
        print(f"  {name}'s share every 5 s: {' '.join(f'{v:.2f}' for v in values)}")
    phases = r["admitted_per_phase"]
    print(
        f"  admitted per {r['phase_seconds']:g} s phase (offered"
        f" {r['offered_per_minute'] * r['phase_seconds'] / 60:.0f} each, the limit refills"
        f" {r['L_rpm'] * r['phase_seconds'] / 60:.0f}): fleet {phases['fleet']}, single"
        f" {phases['single']}"
    )


# -- main -------------------------------------------------------------------------------------


def copy_logs(folders: dict[str, Path], out: Path) -> None:
    for name, folder in folders.items():
        log = folder / "server.log"
        if log.exists():
            shutil.copyfile(log, out.parent / f"{out.stem}-{name}.log")


@contextlib.contextmanager
def work_folder(parent: Path) -> Iterator[Path]:
    parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=parent, prefix="fleet-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run(args: argparse.Namespace, pg: PostgresServer, work: Path) -> dict:
    report: dict[str, Any] = {}
    print("== 1a. in-process gateway (no replicas running yet)", flush=True)
    inproc_url = fresh_database(pg)
    migrate(inproc_url)
    report["inproc"] = run_uvloop(inproc(inproc_url, work / "inproc.db", args))
    print_inproc(report["inproc"])
    with contextlib.ExitStack() as stack:
        fleet = start_all(stack, pg, work, args)
        stack.callback(copy_logs, fleet.folders, args.out)
        print("== 1b. served TTFT", flush=True)
        report["served_ttft"] = asyncio.run(served_ttft(fleet, args))
        print_ttft(report["served_ttft"])
        print("== 2. usable budget: the fleet", flush=True)
        fleet_usable = usable_fleet(fleet, args)
        print("== 2. usable budget: 3 SQLite replicas", flush=True)
        solo_usable = usable_solo(fleet, args)
        report["usable_budget"] = {"fleet": fleet_usable, "sqlite_contrast": solo_usable}
        print_usable(fleet_usable, solo_usable)
        print("== 3. rate overshoot", flush=True)
        report["rate_overshoot"] = rate_overshoot(fleet, args)
        print_rates(report["rate_overshoot"])
    return report


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop all
    os.environ.pop(STORE_ENV, None)  # the solo replicas must not find a fleet's store
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.perf_counter()
    with work_folder(args.dir) as work, PostgresServer(require_postgres()) as pg:
        report = run(args, pg, work)
    wall = time.perf_counter() - started
    report = {
        "quick": args.quick,
        "cpus": cpu_count(),
        "loadavg_at_end": os.getloadavg(),
        "wall_s": wall,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **report,
    }
    write_json(args.out, report)
    print(f"\nwrote {args.out} ({wall:.0f}s in all)")
    return report


if __name__ == "__main__":
    main()
