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
copied to bench-results/fleet-NAME.log. The parts live in _fleet_inproc.py (1a),
_fleet_budget.py (2) and _fleet_rates.py (3); the replicas and helpers in _fleet_base.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anthropic
from _common import ROOT, cpu_count, print_table, write_json
from _fleet_base import MODEL, OUT, Fleet, fmt, median, percentile, ratio, start_all
from _fleet_budget import print_usable, usable_fleet, usable_solo
from _fleet_inproc import inproc, print_inproc, run_uvloop
from _fleet_rates import audit_records, print_rates, rate_overshoot, record_time

from tests.pg_fixtures import fresh_database
from tests.postgres_server import PostgresServer, require_postgres
from zerohop.gateway.store.pg_migrations import migrate
from zerohop.gateway.store.spec import STORE_ENV


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
