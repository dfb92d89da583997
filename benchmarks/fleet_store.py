"""What the fleet store adds per batch line and per stored response, against the SQLite files
a single replica uses: the store calls a runner makes for each line (`next_waiting`,
`mark_running`, `record_result`, and its share of the per-second lease renewal), and a
stored response's write and read (`put_response`, `get_response`), timed on a real local
PostgreSQL (tests/postgres_server.py: `initdb` in a temporary folder, fsync on) and on
SQLite files in a temporary folder, alternating the two.

    .venv/bin/python benchmarks/fleet_store.py [--lines 2000] [--responses 500] [--rounds 2]

Prints a table and writes bench-results/fleet_store.json. The network between a replica
and its PostgreSQL adds its round trips on top (4 per line, 1 per response write or read).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from _common import ROOT, print_table, write_json

from tests.pg_fixtures import migrated_database
from tests.postgres_server import PostgresServer, require_postgres
from zerohop.batches.pg_store import PgBatchStore
from zerohop.batches.store import SUCCEEDED, BatchStore, NewBatch, NewLine
from zerohop.gateway.store.postgres import PostgresStore
from zerohop.gateway.store.response_tables import ResponseRow
from zerohop.gateway.store.sqlite import KeyStore

RESULT = {"status_code": 200, "body": {"content": [{"type": "text", "text": "x" * 200}]}}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lines", type=int, default=2000)
    p.add_argument("--responses", type=int, default=500)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "fleet_store.json")
    return p.parse_args(argv)


def per_line_ms(store: BatchStore, lines: int) -> float:
    """Milliseconds of store calls per line, as the runner makes them (a page of 8 waiting
    lines at a time, one lease renewal per 8 lines started)."""
    spec = NewBatch("acme", "zh-acme", "anthropic", "/v1/messages", model="m")
    batch_id = store.create_batch(spec, [NewLine(f"l{i}", {"i": i}) for i in range(lines)]).id
    started = time.perf_counter()
    done = 0
    while done < lines:
        page = store.next_waiting(8)
        for waiting in page:
            store.mark_running(batch_id, waiting.line.index)
        store.renew_leases()
        for waiting in page:
            store.record_result(batch_id, waiting.line.index, SUCCEEDED, RESULT)
        done += len(page)
    return (time.perf_counter() - started) * 1000 / lines


def per_response_ms(store: KeyStore | PostgresStore, count: int) -> tuple[float, float]:
    body, items = json.dumps({"output": "y" * 400}), json.dumps([{"role": "user"}] * 4)
    now = time.time()
    rows = [
        ResponseRow(f"resp_{i}", "acme", "completed", body, items, now + 3600) for i in range(count)
    ]
    put = _timed(lambda: [store.put_response(r, now) for r in rows]) / count
    got = _timed(lambda: [store.get_response("acme", r.response_id, now) for r in rows]) / count
    return put, got


def _timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return (time.perf_counter() - started) * 1000


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    samples: dict[str, dict[str, list[float]]] = {
        kind: {"line": [], "put": [], "get": []} for kind in ("sqlite", "postgresql")
    }
    with PostgresServer(require_postgres()) as pg, tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for kind in ("sqlite", "postgresql"):
                folder = Path(tmp) / f"{kind}-{round_}"
                folder.mkdir()
                if kind == "sqlite":
                    batches: BatchStore = BatchStore(folder / "batches.db")
                    keys: KeyStore | PostgresStore = KeyStore(folder / "keys.db")
                else:
                    url = migrated_database(pg)
                    batches = PgBatchStore(url, "bench")  # type: ignore[assignment]
                    keys = PostgresStore(url)
                samples[kind]["line"].append(per_line_ms(batches, args.lines))
                put, got = per_response_ms(keys, args.responses)
                samples[kind]["put"].append(put)
                samples[kind]["get"].append(got)
                batches.close()
                keys.close()
    medians = {k: {m: statistics.median(v) for m, v in s.items()} for k, s in samples.items()}
    rows = [
        [what, f"{medians['sqlite'][m]:.3f}", f"{medians['postgresql'][m]:.3f}",
         f"{medians['postgresql'][m] - medians['sqlite'][m]:+.3f}"]
        for what, m in (("batch line: store calls", "line"), ("stored response: write", "put"),
                        ("stored response: read", "get"))
    ]  # fmt: skip
    print_table(["ms per", "SQLite", "PostgreSQL (local)", "added"], rows)
    report = {"args": vars(args) | {"out": str(args.out)}, "samples": samples, "medians": medians}
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
