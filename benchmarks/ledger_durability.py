"""What the budget ledger's durability costs per request: `--durability normal` against
`full`, side by side in one run, on the real ledger (`BudgetLedger`: its writer thread, SQLite
in WAL mode, group commit) over a store file on a real disk.

Each request does to the ledger what a served budgeted request does: reserve, await the
reservation's commit (admission waits for it before the engine sees the request), settle.
Concurrency 1 makes every reservation a commit of its own (with `full`, an fsync of its own);
at 32, group commit shares one commit among the admissions queued behind it. Rounds alternate
the modes, so the machine's noise falls on both alike.

  .venv/bin/python benchmarks/ledger_durability.py [--requests 300] [--concurrency 1,32]
      [--rounds 3] [--dir DIR]

Per mode and concurrency: the admission's wait for durability (reserve to committed, p50 and
p99), the ledger's wall time per request (reserve + commit + settle, the last settlements
written included) and commits per request; then full / normal. Prints a table and writes
bench-results/ledger_durability.json. The folder's file system is printed too: on a tmpfs an
fsync costs nothing, so measure where the key store really lives (`--dir`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _common import ROOT, print_table, write_json

from zerohop.gateway.budgets.sqlite_ledger import BudgetLedger
from zerohop.gateway.budgets.sqlite_writer import DURABILITIES
from zerohop.gateway.keys.identity import Budget, Identity, Tenant
from zerohop.gateway.store.spec import StoreSpec
from zerohop.gateway.store.sqlite import KeyStore
from zerohop.gateway.store.store import Store

PROMPT, MAX_TOKENS, USED = 128, 64, 150
OUT = ROOT / "bench-results" / "ledger_durability.json"


@dataclass(slots=True)
class Run:
    durability: str
    concurrency: int
    waits_s: list[float]  # per request: reserve -> durable
    wall_s: float  # every request, and the writer drained
    commits: int
    requests: int


async def one_run(db: Path, durability: str, concurrency: int, requests: int) -> Run:
    KeyStore(db).close()  # a fresh store, as `zerohop keys create` leaves it
    store = Store.of(StoreSpec.sqlite(db))
    ledger = BudgetLedger(store.ledger, durability)  # type: ignore[arg-type]
    ledger.start()
    identities = [
        Identity(f"zh-bench{i:03d}", Tenant(f"t{i}", budget=Budget(10**12)), budget=Budget(10**12))
        for i in range(concurrency)
    ]
    waits: list[float] = []
    ids = iter(range(requests))

    async def worker(identity: Identity) -> None:
        for n in ids:
            start = time.perf_counter()
            reservation = ledger.reserve(identity, f"req_{n}", PROMPT, MAX_TOKENS)
            assert reservation is not None
            await ledger.confirm(reservation)
            waits.append(time.perf_counter() - start)
            reservation.used = USED
            ledger.settle(reservation)

    start = time.perf_counter()
    await asyncio.gather(*(worker(identity) for identity in identities))
    await asyncio.to_thread(ledger.close)  # the last settlements written too
    store.close()
    wall = time.perf_counter() - start
    check_spend(db, identities, requests)
    return Run(durability, concurrency, waits, wall, ledger.commits, requests)


def check_spend(db: Path, identities: list[Identity], requests: int) -> None:
    """Every request's USED tokens are durable on its key and tenant, no more, no less."""
    store = KeyStore(db)
    try:
        total = sum(t for s, _, t in store.spend() if s.startswith("key:"))
    finally:
        store.close()
    assert total == requests * USED, (total, requests * USED)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(runs: list[Run]) -> dict:
    waits = [w for r in runs for w in r.waits_s]
    requests = sum(r.requests for r in runs)
    return {
        "durability": runs[0].durability,
        "concurrency": runs[0].concurrency,
        "requests": requests,
        "durable_wait_p50_us": 1e6 * statistics.median(waits),
        "durable_wait_p99_us": 1e6 * percentile(waits, 0.99),
        "ledger_wall_us_per_request": 1e6 * sum(r.wall_s for r in runs) / requests,
        "commits_per_request": sum(r.commits for r in runs) / requests,
    }


def file_system(folder: Path) -> str:
    """The type of the file system `folder` is on, from /proc/mounts (longest mount point)."""
    best, kind = "", "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    resolved = str(folder.resolve())
    for line in mounts:
        fields = line.split()
        point = fields[1]
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, kind = point, fields[2]
    return kind


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="per mode, concurrency, round")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=ROOT / "bench-results")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    args.dir.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[str, int], list[Run]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ledger-") as work:
        for round_ in range(args.rounds):
            for concurrency in levels:
                for durability in DURABILITIES if round_ % 2 == 0 else DURABILITIES[::-1]:
                    db = Path(work) / f"{durability}-{concurrency}-{round_}.db"
                    run = asyncio.run(one_run(db, durability, concurrency, args.requests))
                    runs.setdefault((durability, concurrency), []).append(run)
    report(runs, levels, args)
    return 0


def report(
    runs: dict[tuple[str, int], list[Run]], levels: list[int], args: argparse.Namespace
) -> None:
    rows = {key: summarize(value) for key, value in runs.items()}
    table, ratios = [], {}
    for concurrency in levels:
        normal, full = rows[("normal", concurrency)], rows[("full", concurrency)]
        ratios[concurrency] = {
            "durable_wait_p50": full["durable_wait_p50_us"] / normal["durable_wait_p50_us"],
            "ledger_wall_per_request": full["ledger_wall_us_per_request"]
            / normal["ledger_wall_us_per_request"],
            "added_us_per_request": full["ledger_wall_us_per_request"]
            - normal["ledger_wall_us_per_request"],
        }
        for row in (normal, full):
            table.append(
                [
                    row["durability"],
                    concurrency,
                    row["durable_wait_p50_us"],
                    row["durable_wait_p99_us"],
                    row["ledger_wall_us_per_request"],
                    row["commits_per_request"],
                ]
            )
    fs = file_system(args.dir)
    print(f"ledger on {args.dir} ({fs}), {args.rounds} rounds x {args.requests} requests each")
    headers = ["durability", "conc", "wait p50 us", "wait p99 us", "wall us/req", "commits/req"]
    print_table(headers, table)
    for concurrency, ratio in ratios.items():
        print(
            f"concurrency {concurrency}: full / normal = {ratio['ledger_wall_per_request']:.2f}x"
            f" wall per request (+{ratio['added_us_per_request']:.0f} us),"
            f" {ratio['durable_wait_p50']:.2f}x admission wait p50"
        )
    write_json(
        args.out,
        {
            "file_system": fs,
            "dir": str(args.dir),
            "rounds": args.rounds,
            "requests_per_run": args.requests,
            "results": list(rows.values()),
            "full_over_normal": {str(c): r for c, r in ratios.items()},
            "python": sys.version.split()[0],
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
