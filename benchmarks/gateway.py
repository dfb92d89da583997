"""The gateway's cost, side by side in one run: `zerohop serve --no-gateway` versus the gateway on.

Same server build, same model (the default model unless --model-dir names another), same
workload, same engine options (`--num-threads` --threads, 1 by default); both servers stay up
for the whole run and are driven one at a time:
  off  `zerohop serve MODEL --no-gateway`: no keys, limits, budgets, audit or metrics;
  on   `zerohop serve MODEL --keys-db STORE --audit-dir DIR`: a store of --keys (1,000) keys
       over --tenants (50) tenants, every key and every tenant with rate limits (rpm, itpm,
       otpm, max concurrency) and a token budget, all too generous ever to refuse; audit on;
       GET /metrics scraped every --scrape-interval (1 s) while each "on" run lasts.
The load client (`zerohop bench`'s: OpenAI /v1/completions, streaming, prompts of English text
in the model's own tokens) sends one of the keys to both servers (the "off" one ignores it).

Per --repeats round (3), each workload runs on "off" and "on" in turn (the order alternates
from round to round), with prompts of its own in each round (no prefix-cache hits across runs):
  throughput  --concurrency (32) streams, --num-requests (128) x 128 in -> 64 out: output tok/s;
  ttft        concurrency 1, --ttft-requests (30) x 128 in -> --ttft-output-tokens (1): TTFT p50;
  cpu         the API process's CPU (user + system time, all its threads; `_procstat`) over each
              run, per request (the run's warm-up request included; the "on" runs' /metrics
              scrapes too, as they are part of what the gateway costs).
Each figure counts at its best round (highest throughput, lowest TTFT and CPU: a shared machine
only ever slows a run down); the medians of the per-round on/off pairs are printed too.

Then, in this process, on the real objects with a copy of the same store (keys cycled over all
of them), the gateway's CPU per request by component, timeit best of 5: auth, limits (admit,
64 per-token charges, release, rate-limit headers), budget (reserve and settle on the event
loop; the ledger writer's commits), audit (building the entry, `record`, the writer per record),
metrics (`request_finished` with 64 token times; `render` per scrape, amortized over the served
request rate) and the per-token bookkeeping of `Gateway.on_delta`; and the whole gateway path
on a uvloop event loop with its writer threads running (this process's CPU, all threads, less
the same loop without the gateway) at concurrency 1 and --concurrency, which also counts the
budget ledger's group commits per request.

Targets: throughput on/off >= 0.98 at 32 streams; TTFT p50 on - off < 1 ms at concurrency 1.

    .venv/bin/python benchmarks/gateway.py [--repeats 3] [--out bench-results/gateway.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import timeit
import urllib.request
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import ROOT, cpu_count, model_path, print_table, write_json
from serve import SERVED_MODEL_NAME, CpuMeter, Server, free_port, load_config, prompt_maker

from zerohop.api.http.rate_headers import openai_rate_headers
from zerohop.api.service import new_request_id
from zerohop.bench.load import run_benchmark
from zerohop.bench.load_types import BenchConfig
from zerohop.gateway.audit.log import AuditLog, verify
from zerohop.gateway.auth import Authenticator
from zerohop.gateway.budgets.sqlite_ledger import BudgetLedger, Reservation
from zerohop.gateway.gateway import Call, Gateway, audit_entry
from zerohop.gateway.keys.identity import Budget, Identity, Limits, Tenant
from zerohop.gateway.limits import buckets as limits
from zerohop.gateway.metrics import GatewayMetrics
from zerohop.gateway.store.sqlite import KeyStore

MODES = ("off", "on")
THROUGHPUT_TARGET = 0.98  # on / off at 32 streams
TTFT_TARGET_MS = 1.0  # on - off, p50 at concurrency 1
# Every key and tenant is limited and budgeted, generously enough never to refuse a request.
KEY_LIMITS = Limits(rpm=1_000_000, itpm=10**9, otpm=10**9, max_concurrency=1_000)
TENANT_LIMITS = Limits(rpm=10_000_000, itpm=10**10, otpm=10**10, max_concurrency=10_000)
KEY_BUDGET = Budget(10**12, "day")
TENANT_BUDGET = Budget(10**13, "month")
# What GET /metrics renders the engine's gauges from (`EngineStats`, as `render` takes it).
ENGINE_STATS = {
    "num_running": 32, "num_waiting": 0, "num_blocks": 1024, "blocks_in_use": 400,
    "prefix_query_tokens": 10**6, "prefix_hit_tokens": 10**5,
}  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model-dir",
        default=None,
        help="a .gguf file or a Hugging Face folder, or `standard` or `tiny` "
        "(default: zerohop's default model, SmolLM2-135M-Instruct)",
    )
    p.add_argument("--threads", type=int, default=1, help="engine torch threads (both servers)")
    p.add_argument("--concurrency", type=int, default=32, help="streams of the throughput run")
    p.add_argument("--num-requests", type=int, default=128, help="requests of the throughput run")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--ttft-requests", type=int, default=30, help="requests at concurrency 1")
    p.add_argument("--ttft-output-tokens", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="rounds of off/on; best counts")
    p.add_argument("--keys", type=int, default=1000, help="keys in the store")
    p.add_argument("--tenants", type=int, default=50, help="tenants the keys are spread over")
    p.add_argument("--scrape-interval", type=float, default=1.0, help="seconds between scrapes")
    p.add_argument(
        "--timeit-requests", type=int, default=2000, help="requests per in-process timing pass"
    )
    p.add_argument(
        "--path-requests", type=int, default=1000, help="requests of the in-process whole path"
    )
    p.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB, each server")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--skip-served", action="store_true", help="the in-process breakdown only")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "gateway.json")
    return p.parse_args(argv)


# -- the key store ---------------------------------------------------------------------------------


def build_store(path: Path, keys: int, tenants: int) -> list[str]:
    """`keys` keys over `tenants` tenants, all limited and budgeted; returns their secrets."""
    store = KeyStore(path)
    try:
        names = [f"tenant-{t:03d}" for t in range(tenants)]
        for name in names:
            store.upsert_tenant(Tenant(name, TENANT_LIMITS, TENANT_BUDGET))
        return [
            store.create_key(
                names[i % tenants], name=f"bench-{i:04d}", limits=KEY_LIMITS, budget=KEY_BUDGET
            )[0]
            for i in range(keys)
        ]
    finally:
        store.close()


def copy_store(src: Path, dst: Path) -> Path:
    """A consistent copy of a SQLite store (the backup API: WAL contents included)."""
    source, target = sqlite3.connect(src), sqlite3.connect(dst)
    try:
        source.backup(target)
    finally:
        source.close()
        target.close()
    return dst


# -- served: off vs on -----------------------------------------------------------------------------


class GatewayServer(Server):
    """`zerohop serve` with serve.py's engine options and the given gateway flags."""

    def __init__(self, args: argparse.Namespace, model: Path, gateway: list[str], log: Path):
        self.port = free_port()
        self.log = log
        cmd = [
            sys.executable, "-m", "zerohop", "serve", str(model),
            "--port", str(self.port), "--grpc-port", "0",
            "--served-model-name", SERVED_MODEL_NAME, "--num-threads", str(args.threads),
            "--max-num-seqs", "64", "--kv-cache-memory", str(args.kv_cache_memory),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            *gateway,
        ]  # fmt: skip
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


class Scraper:
    """GET /metrics every `interval` seconds from a thread (the first at once) until stopped."""

    def __init__(self, url: str, interval: float) -> None:
        self.url, self.interval = url + "/metrics", interval
        self.seconds: list[float] = []
        self.errors = 0
        self.body_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-scraper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            start = time.perf_counter()
            try:
                with urllib.request.urlopen(self.url, timeout=5.0) as r:
                    self.body_bytes = len(r.read())
                self.seconds.append(time.perf_counter() - start)
            except OSError:
                self.errors += 1
            if self._stop.wait(max(0.0, self.interval - (time.perf_counter() - start))):
                return

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        p50 = 1000 * statistics.median(self.seconds) if self.seconds else None
        return {
            "scrapes": len(self.seconds),
            "errors": self.errors,
            "body_bytes": self.body_bytes,
            "p50_ms": p50,
        }


def workloads(args: argparse.Namespace, url: str, key: str, rep: int) -> dict[str, BenchConfig]:
    """One round's runs; both servers get the same prompts, each round new ones."""
    throughput = load_config(
        args, url, api_key=key, concurrency=args.concurrency, requests=args.num_requests,
        output_tokens=args.output_tokens, seed=rep,
    )  # fmt: skip
    ttft = load_config(
        args, url, api_key=key, concurrency=1, requests=args.ttft_requests,
        output_tokens=args.ttft_output_tokens, seed=1000 + rep,
    )  # fmt: skip
    return {"throughput": throughput, "ttft": ttft}


def measure_run(
    server: Server, idle: Server, cfg: BenchConfig, scrape_interval: float | None
) -> dict:
    """One load run; the API process's CPU over it (and the idle server's, as a check)."""
    cpu, idle_cpu = CpuMeter(server.process.pid), CpuMeter(idle.process.pid)
    scraper = Scraper(server.url, scrape_interval) if scrape_interval else None
    report = run_benchmark(cfg)
    scrapes = scraper.stop() if scraper else None
    used, idle_used = cpu.stop(), idle_cpu.stop()
    s = report["summary"]
    requests = s["completed"] + s["failed"] + cfg.warmup_requests
    return {
        "output_throughput": s["output_throughput"],
        "request_throughput": s["request_throughput"],
        "ttft_p50_ms": (s["ttft_ms"] or {}).get("p50"),
        "completed": s["completed"],
        "failed": s["failed"],
        "errors": s["errors"],
        "checks": s["checks"],
        "requests_incl_warmup": requests,
        "api_cpu_s": used["api_s"],
        "api_cpu_ms_per_request": 1000 * used["api_s"] / requests,
        "engine_cpu_s": used.get("engine_s"),
        "client_cpu_s": used["client_s"],
        "wall_s": used["wall_s"],
        "idle_server_api_cpu_s": idle_used["api_s"],
        "idle_server_engine_cpu_s": idle_used.get("engine_s"),
        "scrapes": scrapes,
    }


def print_run(rep: int, name: str, mode: str, run: dict) -> None:
    scrapes = f", {run['scrapes']['scrapes']} scrapes" if run["scrapes"] else ""
    failed = f", {run['failed']} FAILED ({run['errors']})" if run["failed"] else ""
    print(
        f"  round {rep + 1} {name:<10} {mode:<3}: {run['output_throughput']:7.1f} out tok/s, "
        f"TTFT p50 {run['ttft_p50_ms']:7.2f} ms, API CPU {run['api_cpu_ms_per_request']:.2f} "
        f"ms/request ({run['api_cpu_s']:.2f}s / {run['requests_incl_warmup']}){scrapes}{failed}",
        flush=True,
    )


def warm_up(args: argparse.Namespace, server: Server, key: str) -> None:
    cfg = load_config(
        args, server.url, api_key=key, concurrency=args.concurrency, requests=args.concurrency,
        output_tokens=8, seed=999,
    )  # fmt: skip
    if run_benchmark(cfg)["summary"]["failed"]:
        raise RuntimeError(f"warm-up requests failed; log: {server.log}")


def served(args: argparse.Namespace, model: Path, store: Path, audit_dir: Path, key: str) -> dict:
    logs = args.out.parent
    servers = {
        "off": GatewayServer(args, model, ["--no-gateway"], logs / "gateway-server-off.log"),
        "on": GatewayServer(
            args, model, ["--keys-db", str(store), "--audit-dir", str(audit_dir)],
            logs / "gateway-server-on.log",
        ),
    }  # fmt: skip
    rounds: list[dict[str, dict]] = []
    try:
        start = time.perf_counter()
        for server in servers.values():
            server.wait_ready()
        print(f"  both servers ready in {time.perf_counter() - start:.1f}s", flush=True)
        for server in servers.values():
            warm_up(args, server, key)
        for rep in range(args.repeats):
            order = MODES if rep % 2 == 0 else MODES[::-1]
            runs: dict[str, dict] = {mode: {} for mode in MODES}
            for name in ("throughput", "ttft"):
                for mode in order:
                    server, idle = servers[mode], servers["on" if mode == "off" else "off"]
                    cfg = workloads(args, server.url, key, rep)[name]
                    scrape = args.scrape_interval if mode == "on" else None
                    runs[mode][name] = measure_run(server, idle, cfg, scrape)
                    print_run(rep, name, mode, runs[mode][name])
            rounds.append(runs)
    finally:
        for server in servers.values():
            server.stop()
    return {
        "rounds": rounds,
        "summary": served_summary(rounds),
        "audit": audit_check(audit_dir, rounds, args),
        "server_logs": {mode: str(s.log) for mode, s in servers.items()},
    }


def audit_check(audit_dir: Path, rounds: list[dict], args: argparse.Namespace) -> dict:
    """The "on" server's audit chain, verified; one record per request it answered."""
    result = verify(audit_dir)
    sent = sum(run["requests_incl_warmup"] for r in rounds for run in r["on"].values())
    return {
        "chain_ok": result.ok,
        "records": result.records,
        "requests_sent": sent + args.concurrency + 1,  # + warm_up()'s, its own warm-up too
        "first_broken": result.first_broken,
    }


# Figures of the served runs: (run, field, which way is better).
FIGURES = {
    "throughput_tok_s": ("throughput", "output_throughput", max),
    "ttft_p50_ms": ("ttft", "ttft_p50_ms", min),
    "cpu_ms_per_request_c32": ("throughput", "api_cpu_ms_per_request", min),
    "cpu_ms_per_request_c1": ("ttft", "api_cpu_ms_per_request", min),
}


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def served_summary(rounds: list[dict]) -> dict:
    """Each figure at its best round per mode, on/off and on-off of the bests, and the median
    over rounds of the paired (same round) on/off and on-off."""
    out = {}
    for figure, (run, field, better) in FIGURES.items():
        values = {mode: [r[mode][run][field] for r in rounds] for mode in MODES}
        off, on = better(values["off"]), better(values["on"])
        pairs = list(zip(values["off"], values["on"], strict=True))
        out[figure] = {
            "off": off,
            "on": on,
            "on_over_off": on / off if off else None,
            "on_minus_off": on - off,
            # None when every off figure was 0 (tiny runs: /proc counts CPU in 10 ms ticks).
            "median_paired_ratio": _median_or_none([b / a for a, b in pairs if a]),
            "median_paired_diff": statistics.median(b - a for a, b in pairs),
            "per_round": values,
        }
    scrapes = [r["on"][run]["scrapes"] for r in rounds for run in ("throughput", "ttft")]
    out["scrapes"] = {
        "total": sum(s["scrapes"] for s in scrapes),
        "errors": sum(s["errors"] for s in scrapes),
        "body_bytes": max(s["body_bytes"] for s in scrapes),
        "p50_ms": statistics.median(s["p50_ms"] for s in scrapes if s["p50_ms"] is not None),
    }
    best_on = max((r["on"]["throughput"] for r in rounds), key=lambda x: x["output_throughput"])
    out["on_request_rate_c32"] = best_on["request_throughput"]
    out["failed"] = sum(run["failed"] for r in rounds for m in MODES for run in r[m].values())
    return out


# -- in process: the gateway's CPU per request by component ----------------------------------------


@dataclass(slots=True)
class Req:
    """One request of the workload: its key, identity and the Call it ends with."""

    key: str
    identity: Identity
    call: Call


def finished_call(identity: Identity, prompt: int, output: int) -> Call:
    """A Call as a served request leaves it: admitted, `output` tokens 10 ms apart."""
    call = Call(new_request_id(), "openai", "127.0.0.1", "1.1", identity=identity)
    call.model, call.prompt_tokens, call.output_tokens = SERVED_MODEL_NAME, prompt, output
    call.admitted_at = call.started + 0.001
    call.first_delta_at = call.first_token_at = call.started + 0.02
    call.token_times = [call.started + 0.02 + 0.01 * i for i in range(output)]
    call.decision, call.stop_reason, call.status = "admitted", "length", 200
    return call


def make_requests(
    auth: Authenticator, keys: list[str], n: int, prompt: int, output: int
) -> list[Req]:
    """`n` requests, their keys taken in turn from all of `keys`."""
    reqs = []
    for i in range(n):
        key = keys[i % len(keys)]
        identity = auth.authenticate(key)
        reqs.append(Req(key, identity, finished_call(identity, prompt, output)))
    return reqs


def per_item_us(
    stmt: Callable[[Any], object],
    items: Sequence[Any],
    setup: Callable[[], object] | None = None,
    repeat: int = 5,
) -> float:
    """Microseconds per item of `stmt(item)` over `items`: timeit (gc off), best of `repeat`,
    less the same loop calling a function that does nothing."""

    def best(fn: Callable[[Any], object]) -> float:
        timer = timeit.Timer(
            "for item in items: stmt(item)",
            setup=setup or "pass",
            globals={"items": items, "stmt": fn},
        )
        return min(timer.repeat(repeat=repeat, number=1)) / len(items) * 1e6

    return max(0.0, best(stmt) - best(_nothing))


def _nothing(item: Any) -> None:
    return None


def time_auth(gateway: Gateway, reqs: list[Req]) -> dict[str, float]:
    def authenticate(r: Req) -> None:
        gateway.authenticate(r.call, r.key)
        gateway.check_model(r.call, SERVED_MODEL_NAME)

    return {"authenticate + check_model": per_item_us(authenticate, reqs)}


def time_limits(gateway: Gateway, reqs: list[Req], prompt: int, output: int) -> dict[str, float]:
    limiter = gateway.limiter
    tokens = range(output)
    held: dict[int, list] = {}

    def admit(r: Req) -> None:
        admitted = limiter.admit(r.identity, prompt)
        assert isinstance(admitted, list), admitted
        held[id(r)] = admitted

    def release(r: Req) -> None:
        limits.release(held.pop(id(r), []))

    def release_all() -> None:
        for r in reqs:
            release(r)

    def admit_all() -> None:
        release_all()
        for r in reqs:
            admit(r)

    def charge(r: Req) -> None:
        subjects = held[id(r)]
        for _ in tokens:
            limits.charge_output(subjects, 1)

    admit_us = per_item_us(admit, reqs, release_all)
    admit_all()
    charge_us = per_item_us(charge, reqs)
    release_us = per_item_us(release, reqs, admit_all)
    release_all()
    return {
        "admit": admit_us,
        f"charge_output x{output}": charge_us,
        "release": release_us,
        "rate-limit headers (openai)": per_item_us(
            lambda r: openai_rate_headers(gateway, r.call), reqs
        ),
    }


async def time_budget(ledger: BudgetLedger, reqs: list[Req], prompt: int, output: int) -> dict:
    """The event loop's side: the ledger's writer is not running, its queue just grows."""
    reservations: list[Reservation] = []
    rounds = itertools.count()  # a request id reserves once: each round has its own

    def reserve(r: Req) -> None:
        request_id = f"{r.call.request_id}-{next(rounds)}"
        reservations.append(ledger.reserve(r.identity, request_id, prompt, output))

    def fresh() -> None:
        reservations.clear()
        for r in reqs:
            reserve(r)
        for res in reservations:
            res.used = prompt + output

    reserve_us = per_item_us(reserve, reqs, reservations.clear)
    settle_us = per_item_us(ledger.settle, reservations, fresh)
    return {"reserve (event loop)": reserve_us, "settle (event loop)": settle_us}


def time_audit(directory: Path, reqs: list[Req]) -> dict:
    log = AuditLog(directory)  # not started: record() only queues
    now = time.monotonic()
    entries: list[dict] = []

    def fresh() -> None:
        log._queue.clear()
        entries[:] = [audit_entry(r.call, now, log.include_content) for r in reqs]

    steps = {
        "audit_entry": per_item_us(lambda r: audit_entry(r.call, now, False), reqs),
        "record": per_item_us(log.record, entries, fresh),
    }
    log._queue.clear()
    batch = [audit_entry(r.call, now, False) for r in reqs[:32]]
    return steps | {"writer": audit_writer(log, batch)}


def audit_writer(log: AuditLog, entries: list[dict], repeat: int = 10) -> dict:
    """The writer's cost of one flush of 1 and of len(entries) records (serialize, hash, write,
    fsync; run here, in this thread): CPU fit as per flush + per record, and the flush's wall."""
    log._open()
    cpu, wall = {}, {}
    try:
        for size in (1, len(entries)):
            samples = []
            for _ in range(repeat):
                log._queue.extend(dict(e) for e in entries[:size])
                c0, w0 = time.thread_time(), time.perf_counter()
                log._write_batch()
                samples.append((time.thread_time() - c0, time.perf_counter() - w0))
            cpu[size] = min(c for c, _ in samples) * 1e6
            wall[size] = statistics.median(w for _, w in samples) * 1e6
    finally:
        log.close()
    big = len(entries)
    per_record = (cpu[big] - cpu[1]) / (big - 1)
    return {
        "cpu_us_per_record": max(0.0, per_record),
        "cpu_us_per_flush": max(0.0, cpu[1] - per_record),
        "flush_wall_us": wall,
        "flush_interval_s": log.flush_interval,
    }


def time_metrics(auth: Authenticator, reqs: list[Req]) -> dict:
    metrics = GatewayMetrics(SERVED_MODEL_NAME, block_size=16, request_metrics_max_age_s=0.0)
    finishing = Gateway(auth, None, metrics=metrics)  # finish() = request_finished only

    def render_fresh(_: int) -> None:
        metrics._version += 1  # a request ended since the last scrape: the full rendering
        metrics.render(ENGINE_STATS)

    finished = per_item_us(lambda r: finishing.finish(r.call, 200), reqs)
    body, _ = metrics.render(ENGINE_STATS)
    return {
        "request_finished (via Gateway.finish)": finished,
        "render_us_per_scrape": per_item_us(render_fresh, range(50)),
        "render_cached_us": per_item_us(lambda _: metrics.render(ENGINE_STATS), range(200)),
        "render_body_bytes": len(body),
        "tenant_series": len({r.identity.tenant.name for r in reqs}),
    }


def time_bookkeeping(gateway: Gateway, reqs: list[Req], output: int) -> float:
    """Gateway.on_delta x output (one token a step), each charging the limiter once."""
    calls: list[Call] = []
    tokens = range(output)

    def fresh() -> None:
        calls[:] = [Call(r.call.request_id, "openai", identity=r.identity) for r in reqs]
        for call in calls:
            call.reservation = Reservation(call.request_id, [], output, False)

    def deltas(call: Call) -> None:
        for _ in tokens:
            gateway.on_delta(call, 1, 0, time.monotonic())

    return per_item_us(deltas, calls, fresh)


# -- in process: the whole gateway path on an event loop -------------------------------------------


class WriterMeter:
    """Wraps a writer thread's method to sum its CPU (thread_time), wall and calls."""

    def __init__(self, owner: Any, method: str) -> None:
        self.calls, self.items, self.cpu_s, self.wall_s = 0, 0, 0.0, 0.0
        inner = getattr(owner, method)

        def wrapped(*args: Any) -> Any:
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return inner(*args)
            finally:
                self.cpu_s += time.thread_time() - c0
                self.wall_s += time.perf_counter() - w0
                self.calls += 1
                self.items += len(args[1]) if len(args) > 1 else 0

        setattr(owner, method, wrapped)  # the instance attribute wins over the class's

    def snapshot(self) -> tuple[int, int, float, float]:
        return self.calls, self.items, self.cpu_s, self.wall_s


async def one_request(gateway: Gateway | None, r: Req, prompt: int, output: int) -> None:
    """The gateway's calls in a served request's order; an engine step is `sleep(0)`."""
    call = Call(new_request_id(), "openai", "127.0.0.1", "1.1")
    if gateway is not None:
        gateway.authenticate(call, r.key)
        gateway.check_model(call, SERVED_MODEL_NAME)
        await gateway.admit(call, prompt, output)
        openai_rate_headers(gateway, call)
    for _ in range(output):
        await asyncio.sleep(0)
        if gateway is not None:
            gateway.on_delta(call, 1, 0, time.monotonic())
    if gateway is not None:
        gateway.finish(call, 200)


async def drive(
    gateway: Gateway | None, reqs: list[Req], concurrency: int, p: int, o: int
) -> tuple[float, float]:
    """All of `reqs` by `concurrency` workers; (CPU s of this process, all threads; wall s)."""
    cpu, wall = time.process_time(), time.perf_counter()

    async def worker(first: int) -> None:
        for i in range(first, len(reqs), concurrency):
            await one_request(gateway, reqs[i], p, o)

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    wall = time.perf_counter() - wall
    if gateway is not None and gateway.audit is not None:
        await asyncio.sleep(gateway.audit.flush_interval + 0.1)  # its last flush (no CPU)
    await asyncio.sleep(0.05)  # the ledger's last settles
    return time.process_time() - cpu, wall


async def whole_path(
    store: Path, audit_dir: Path, reqs: list[Req], concurrencies: Sequence[int], p: int, o: int
) -> dict:
    audit = AuditLog(audit_dir)
    metrics = GatewayMetrics(SERVED_MODEL_NAME, block_size=16)
    gateway = Gateway.from_store(store, audit=audit, metrics=metrics)
    gateway.start()
    audit.start()
    gateway.start_watching()
    assert gateway.ledger is not None
    ledger = WriterMeter(gateway.ledger.writer, "_commit")
    writer = WriterMeter(audit, "_write_batch")
    out = {}
    try:
        await drive(gateway, reqs[:64], 8, p, o)  # warm-up
        for c in concurrencies:
            bare_cpu, _ = await drive(None, reqs, c, p, o)
            before = ledger.snapshot(), writer.snapshot()
            cpu, wall = await drive(gateway, reqs, c, p, o)
            out[c] = path_figures(len(reqs), cpu - bare_cpu, wall, before, (ledger, writer))
    finally:
        await gateway.close()
    return out


def path_figures(
    n: int, cpu: float, wall: float, before: tuple, meters: tuple[WriterMeter, WriterMeter]
) -> dict:
    (l_calls, l_ops, l_cpu, l_wall), (_, _, a_cpu, _) = before
    ledger, audit = meters
    commits = ledger.calls - l_calls
    return {
        "requests": n,
        "requests_per_s": n / wall,
        "gateway_cpu_us_per_request": 1e6 * cpu / n,
        "ledger_commits_per_request": commits / n,
        "ledger_ops_per_commit": (ledger.items - l_ops) / commits if commits else None,
        "ledger_writer_cpu_us_per_request": 1e6 * (ledger.cpu_s - l_cpu) / n,
        "ledger_commit_wall_us": 1e6 * (ledger.wall_s - l_wall) / commits if commits else None,
        "audit_writer_cpu_us_per_request": 1e6 * (audit.cpu_s - a_cpu) / n,
    }


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def breakdown(args: argparse.Namespace, store: Path, keys: list[str], work: Path) -> dict:
    p, o = args.input_tokens, args.output_tokens
    auth = Authenticator(store)
    auth.load()
    gateway = Gateway(auth, None)
    reqs = make_requests(auth, keys, args.timeit_requests, p, o)
    steps = {
        "auth": time_auth(gateway, reqs),
        "limits": time_limits(gateway, reqs, p, o),
        "budget": run_async(time_budget(BudgetLedger(store), reqs, p, o)),
        "audit": time_audit(work / "audit-timeit", reqs),
        "metrics": time_metrics(auth, reqs),
        "bookkeeping": {f"on_delta x{o}": time_bookkeeping(gateway, reqs, o)},
    }
    path_reqs = make_requests(auth, keys, args.path_requests, p, o)
    concurrencies = sorted({1, args.concurrency})
    path = run_async(whole_path(store, work / "audit-path", path_reqs, concurrencies, p, o))
    run_async(auth.stop())  # closes its store
    return {"steps": steps, "whole_path": path, "keys": len(keys), "timeit_requests": len(reqs)}


def components(report: dict, args: argparse.Namespace) -> list[dict]:
    """The breakdown's steps as one served request pays them, µs: the writers' per request
    cost at the whole path's concurrency (ledger) and at the served request rate (audit,
    metrics rendering every --scrape-interval)."""
    b, o, c = report["breakdown"], args.output_tokens, args.concurrency
    s, path = b["steps"], b["whole_path"][c]
    served_ = report.get("served")
    rate = served_["summary"]["on_request_rate_c32"] if served_ else None
    lim, audit, metrics = s["limits"], s["audit"], s["metrics"]
    writer = audit["writer"]
    per_flush = max(1.0, (rate or 0.0) * writer["flush_interval_s"])
    scrape = args.scrape_interval
    per_token = s["bookkeeping"][f"on_delta x{o}"] - lim[f"charge_output x{o}"]
    commits = path["ledger_commits_per_request"]
    rows = [
        ("auth", "authenticate + check_model", s["auth"]["authenticate + check_model"]),
        *(("limits", k, v) for k, v in lim.items()),
        *(("budget", k, v) for k, v in s["budget"].items()),
        ("budget", f"ledger writer ({commits:.2f} commits/request at c={c})",
         path["ledger_writer_cpu_us_per_request"]),
        ("audit", "audit_entry", audit["audit_entry"]),
        ("audit", "record", audit["record"]),
        ("audit", f"writer ({per_flush:.1f} records/flush)",
         writer["cpu_us_per_record"] + writer["cpu_us_per_flush"] / per_flush),
        ("metrics", f"request_finished ({o} token times)",
         metrics["request_finished (via Gateway.finish)"]),
        ("metrics", f"render every {scrape:g}s at {rate:.1f} req/s" if rate else
         "render (no served rate to amortize over)",
         metrics["render_us_per_scrape"] / (scrape * rate) if rate else None),
        ("per token", f"on_delta x{o}, beyond charge_output", max(0.0, per_token)),
    ]  # fmt: skip
    return [{"component": comp, "step": step, "us_per_request": us} for comp, step, us in rows]


# -- report ----------------------------------------------------------------------------------------


def print_served(summary: dict) -> None:
    print("\n== gateway off vs on, served (best of the rounds)")
    names = {
        "throughput_tok_s": "output tok/s, c=32",
        "ttft_p50_ms": "TTFT p50 ms, c=1",
        "cpu_ms_per_request_c32": "API CPU ms/request, c=32",
        "cpu_ms_per_request_c1": "API CPU ms/request, c=1",
    }
    rows = []
    for key, label in names.items():
        f = summary[key]
        rows.append([label, f["off"], f["on"], f["on_over_off"], f["on_minus_off"],
                     f["median_paired_ratio"], f["median_paired_diff"]])  # fmt: skip
    headers = ["figure", "off", "on", "on/off", "on-off", "median on/off", "median on-off"]
    print_table(headers, rows)
    thr, ttft = summary["throughput_tok_s"], summary["ttft_p50_ms"]
    print(
        f"throughput on/off {thr['on_over_off']:.3f} (target >= {THROUGHPUT_TARGET}: "
        f"{_met(thr['on_over_off'] >= THROUGHPUT_TARGET)}); TTFT p50 on-off "
        f"{ttft['on_minus_off']:+.2f} ms (target < {TTFT_TARGET_MS} ms: "
        f"{_met(ttft['on_minus_off'] < TTFT_TARGET_MS)}); medians over rounds in the last columns"
    )
    sc = summary["scrapes"]
    print(
        f"/metrics scraped {sc['total']} times during the 'on' runs ({sc['errors']} errors), "
        f"p50 {sc['p50_ms']:.2f} ms, {sc['body_bytes']:,} bytes; "
        f"failed requests: {summary['failed']}"
    )


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def print_breakdown(report: dict, args: argparse.Namespace) -> None:
    b, rows = report["breakdown"], report["components"]
    print(f"\n== gateway CPU per request by component (in process, µs; {b['keys']} keys in turn)")
    print_table(["component", "step", "µs/request"], [list(r.values()) for r in rows])
    totals = report["component_totals_us"]
    print("per component: " + ", ".join(f"{k} {v:.1f}" for k, v in totals.items()))
    m = b["steps"]["metrics"]
    print(
        f"render: {m['render_us_per_scrape']:.0f} µs a scrape when requests ended since the "
        f"last ({m['render_body_bytes']:,} bytes, {m['tenant_series']} tenants), "
        f"{m['render_cached_us']:.0f} µs when none did"
    )
    for c, f in b["whole_path"].items():
        print(
            f"whole gateway path, c={c}, {args.input_tokens} in -> {args.output_tokens} out: "
            f"{f['gateway_cpu_us_per_request']:.1f} µs CPU/request, "
            f"all threads (ledger writer {f['ledger_writer_cpu_us_per_request']:.1f}: "
            f"{f['ledger_commits_per_request']:.2f} commits/request of "
            f"{f['ledger_ops_per_commit'] or 0:.1f} ops, {f['ledger_commit_wall_us'] or 0:.0f} "
            f"µs each; audit writer {f['audit_writer_cpu_us_per_request']:.1f}), "
            f"{f['requests_per_s']:.0f} req/s"
        )
    if served_ := report.get("served"):
        s = served_["summary"]
        c32, c1 = s["cpu_ms_per_request_c32"], s["cpu_ms_per_request_c1"]
        print(
            f"served API process, on - off: {1000 * c32['on_minus_off']:+.0f} µs/request at "
            f"c={args.concurrency}, {1000 * c1['on_minus_off']:+.0f} µs at c=1 (best rounds; "
            f"/proc counts 10 ms ticks); audit chain: {served_['audit']}"
        )


def totals(rows: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for row in rows:
        out[row["component"]] = out.get(row["component"], 0.0) + (row["us_per_request"] or 0.0)
    return out | {"total": sum(out.values())}


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    model = model_path(args.model_dir)
    args.prompt_source, _ = prompt_maker(model)
    load_before = os.getloadavg()
    if load_before[0] > 0.5:
        print(f"warning: load average {load_before[0]:.1f} before starting: figures will be noisy")
    work = Path(tempfile.mkdtemp(prefix="zerohop-gateway-bench-"))
    try:
        start = time.perf_counter()
        keys = build_store(work / "keys.db", args.keys, args.tenants)
        seconds = time.perf_counter() - start
        print(f"store: {len(keys)} keys over {args.tenants} tenants in {seconds:.1f}s")
        copy = copy_store(work / "keys.db", work / "keys-inprocess.db")
        report: dict[str, Any] = {"model": str(model), "cpus": cpu_count(), "args": _args(args)}
        print("== in process: the gateway's CPU per request by component", flush=True)
        report["breakdown"] = breakdown(args, copy, keys, work)
        if not args.skip_served:
            print("== served: off vs on", flush=True)
            report["served"] = served(args, model, work / "keys.db", work / "audit", keys[0])
            print_served(report["served"]["summary"])
        report["components"] = components(report, args)
        report["component_totals_us"] = totals(report["components"])
        print_breakdown(report, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["load_average"] = {"before": load_before, "after": os.getloadavg()}
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return report


def _args(args: argparse.Namespace) -> dict:
    return {
        k: str(v) if isinstance(v, Path) else v
        for k, v in vars(args).items()
        if k != "prompt_source"
    }


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
