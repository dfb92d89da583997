"""Message Batches beside interactive traffic, and across a kill -9 (issue 23).

One `zerohop serve` on the default model (serve.py's engine options: --num-threads 2,
--max-num-seqs 64, --kv-cache-memory 2 GiB; the gateway on with a fresh key store, audit
folder and --batches-db of its own, empty: open on loopback), driven through the official
anthropic SDK. Phases, in order:

  idle interactive  --samples (30) streamed requests, one at a time (~90 tokens ->
                    --interactive-max-tokens (32)): TTFT, TPOT and total time, p50/p90
  idle batch        a --lines (2,000) batch (~45 tokens -> --batch-max-tokens (16) a line)
                    on the otherwise idle server: lines per minute, request_counts
  loaded            the same-shaped batch; while it runs the interactive client sends one
                    request at a time: each figure / the idle one's, lines/min / idle's
  idle after        --samples interactive requests again: how far the machine drifted
  crash             a fresh server: a --crash-lines (500) batch, kill -9 of the server's
                    process group at a quarter done, a restart on the same stores, then every
                    custom_id exactly once, all succeeded

Lines running at once come from `zerohop_batch_lines{state="running"}` in GET /metrics,
sampled every 0.25 s. Written to bench-results/batches.json; server logs beside it.

    .venv/bin/python benchmarks/batches.py [--lines 2000] [--crash-lines 500] [--samples 30]
    .venv/bin/python benchmarks/batches.py --quick     # 100 lines, 100 crash lines, 10 samples
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import sqlite3
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anthropic
from _common import PASSAGE, ROOT, model_path, print_table, write_json
from harness.zerohop_server import SERVED_MODEL_NAME, ZerohopServer, metric_by_label

WORDS = PASSAGE.split()
INTERACTIVE_WORDS, BATCH_WORDS = 64, 24  # ~92 and ~47 tokens (the chat template adds ~25)
POLL = 0.25  # seconds between looks at a running batch
STALL = 300.0  # seconds without a line finishing before a batch counts as stuck
KILL_AT = 0.25  # the share of the crash batch's lines done when the server is killed


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", default=None, help="default: zerohop's default model")
    p.add_argument("--threads", type=int, default=2, help="engine threads")
    p.add_argument("--lines", type=int, default=2000, help="lines of the idle and loaded batch")
    p.add_argument("--crash-lines", type=int, default=500, help="lines of the crash batch")
    p.add_argument("--samples", type=int, default=30, help="idle interactive requests")
    p.add_argument("--batch-max-tokens", type=int, default=16)
    p.add_argument("--interactive-max-tokens", type=int, default=32)
    p.add_argument("--batch-max-share", default=None, help="passed to the server (default: its)")
    p.add_argument(
        "--server-arg", action="append", default=[], help="one more `zerohop serve` argument"
    )
    p.add_argument("--skip-crash", action="store_true")
    p.add_argument("--quick", action="store_true", help="100 lines, 100 crash lines, 10 samples")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "batches.json")
    args = p.parse_args(argv)
    if args.quick:
        args.lines, args.crash_lines, args.samples = 100, 100, 10
    return args


# -- the server -----------------------------------------------------------------------------


class BatchServer(ZerohopServer):
    """`zerohop serve` with serve.py's engine options and its stores under `state`, in a
    process group of its own, so that a kill -9 takes the engine process with it."""

    def __init__(self, args: argparse.Namespace, model: Path, state: Path, log: Path) -> None:
        self.state = state
        flags = [
            "--num-threads", str(args.threads), "--max-num-seqs", "64", "--kv-cache-memory",
            "2.0", "--max-num-batched-tokens", "2048", "--keys-db", str(state / "keys.db"),
            "--audit-dir", str(state / "audit"), "--batches-db", str(self.batches_db),
        ]  # fmt: skip
        if args.batch_max_share is not None:
            flags += ["--batch-max-share", str(args.batch_max_share)]
        state.mkdir(parents=True, exist_ok=True)
        super().__init__(model, flags + args.server_arg, log)

    @property
    def batches_db(self) -> Path:
        return self.state / "batches.db"

    def client(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key="unused", max_retries=0)

    def batch_lines(self) -> dict[str, float]:
        """`zerohop_batch_lines` by state, summed over tenants (all batches of the server)."""
        lines = metric_by_label(self.url + "/metrics", "zerohop_batch_lines", "state")
        return collections.defaultdict(float, lines)


def start(args: argparse.Namespace, model: Path, state: Path, name: str) -> BatchServer:
    server = BatchServer(args, model, state, args.out.parent / f"batches-server-{name}.log")
    server.start()
    return server


# -- prompts ------------------------------------------------------------------------------------


def prompt(rng: random.Random, words: int) -> str:
    """A numbered instruction (its own first KV block) and the passage from a random word."""
    first = rng.randrange(len(WORDS))
    body = " ".join(WORDS[(first + i) % len(WORDS)] for i in range(words))
    return f"Note {rng.randrange(10**6):06d}: summarize the text below in one sentence.\n\n{body}"


def batch_requests(rng: random.Random, prefix: str, lines: int, max_tokens: int) -> list[dict]:
    def params() -> dict[str, Any]:
        messages = [{"role": "user", "content": prompt(rng, BATCH_WORDS)}]
        return {"model": SERVED_MODEL_NAME, "max_tokens": max_tokens, "temperature": 0,
                "messages": messages}  # fmt: skip

    return [{"custom_id": f"{prefix}-{i}", "params": params()} for i in range(lines)]


# -- the interactive client -----------------------------------------------------------------


@dataclass(slots=True)
class Sample:
    started: float  # perf_counter
    ttft: float | None  # seconds to the first text delta; None when no text came
    total: float
    output_tokens: int


def interactive(client: anthropic.Anthropic, rng: random.Random, max_tokens: int) -> Sample:
    started = time.perf_counter()
    first = None
    with client.messages.stream(
        model=SERVED_MODEL_NAME,
        max_tokens=max_tokens,
        messages=[{"role": "user", "content": prompt(rng, INTERACTIVE_WORDS)}],
        extra_body={"temperature": 0},
    ) as stream:
        for event in stream:
            text = event.type == "content_block_delta" and event.delta.type == "text_delta"
            if first is None and text and event.delta.text:
                first = time.perf_counter() - started
        usage = stream.get_final_message().usage
    return Sample(started, first, time.perf_counter() - started, usage.output_tokens)


def interactive_run(
    client: anthropic.Anthropic, rng: random.Random, max_tokens: int, more: Callable[[int], bool]
) -> list[Sample]:
    """Requests one after another while `more(samples so far)`."""
    samples: list[Sample] = []
    while more(len(samples)):
        samples.append(interactive(client, rng, max_tokens))
    return samples


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latency(samples: Sequence[Sample]) -> dict[str, Any]:
    ttft = [s.ttft for s in samples if s.ttft is not None]
    total = [s.total for s in samples]
    tpot = [
        (s.total - s.ttft) / (s.output_tokens - 1)
        for s in samples
        if s.ttft is not None and s.output_tokens > 1
    ]
    return {
        "samples": len(samples),
        "no_text": len(samples) - len(ttft),
        "ttft_p50_ms": _ms(percentile(ttft, 0.5)),
        "ttft_p90_ms": _ms(percentile(ttft, 0.9)),
        "total_p50_ms": _ms(percentile(total, 0.5)),
        "total_p90_ms": _ms(percentile(total, 0.9)),
        "tpot_p50_ms": _ms(percentile(tpot, 0.5)),
        "tpot_p90_ms": _ms(percentile(tpot, 0.9)),
        "output_tokens_mean": statistics.fmean(s.output_tokens for s in samples) if samples else 0,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


# -- batches ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Watch:
    """A running batch, seen every POLL s from a thread: retrieve, and the runner's gauges."""

    server: BatchServer
    batch_id: str
    done_before: float = 0.0  # lines of earlier batches in the `done` gauge
    running: list[float] = field(default_factory=list)
    done: float = 0.0
    first_running: float | None = None  # perf_counter
    ended: Any = None  # the MessageBatch once ended
    ended_seen: float = 0.0  # perf_counter when it was seen ended
    error: str = ""
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Watch:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        client, last_change, last_done = self.server.client(), time.monotonic(), -1.0
        while not self._stop.is_set():
            try:
                gauges = self.server.batch_lines()
                batch = client.messages.batches.retrieve(self.batch_id)
            except Exception as e:  # the server was killed: the crash phase stops the watch
                self.error = repr(e)
                return
            self.running.append(gauges["running"])
            self.done = gauges["done"] - self.done_before
            if self.first_running is None and (gauges["running"] or self.done):
                self.first_running = time.perf_counter()
            if batch.processing_status == "ended":
                self.ended, self.ended_seen = batch, time.perf_counter()
                return
            if self.done != last_done:
                last_change, last_done = time.monotonic(), self.done
            elif time.monotonic() - last_change > STALL:
                self.error = f"no line finished in {STALL:.0f}s: {batch.model_dump_json()}"
                return
            time.sleep(POLL)

    def stop(self) -> None:
        self._stop.set()

    @property
    def over(self) -> bool:
        return self.ended is not None or bool(self.error)

    def wait(self, until: Callable[[], bool] | None = None) -> None:
        while not self.over and not (until and until()):
            time.sleep(POLL / 2)
        if self.error:
            raise RuntimeError(f"batch {self.batch_id}: {self.error}")


def create(server: BatchServer, requests: list[dict]) -> Watch:
    done_before = server.batch_lines()["done"]
    batch = server.client().messages.batches.create(requests=requests)
    return Watch(server, batch.id, done_before).start()


def batch_figures(watch: Watch) -> dict[str, Any]:
    batch = watch.ended
    seconds = (batch.ended_at - batch.created_at).total_seconds()
    lines = sum(batch.request_counts.model_dump().values())
    running = [r for r in watch.running if r]
    return {
        "batch_id": batch.id,
        "lines": lines,
        "seconds": seconds,
        "lines_per_min": 60 * lines / seconds if seconds else None,
        "request_counts": batch.request_counts.model_dump(),
        "running_max": max(watch.running, default=0),
        "running_mean": statistics.fmean(running) if running else 0,
    }


def output_tokens(client: anthropic.Anthropic, batch_id: str) -> int:
    return sum(
        r.result.message.usage.output_tokens
        for r in client.messages.batches.results(batch_id)
        if r.result.type == "succeeded"
    )


# -- phases ---------------------------------------------------------------------------------------


def phases_1_to_3(args: argparse.Namespace, server: BatchServer) -> dict[str, Any]:
    client, rng = server.client(), random.Random(0)
    interactive(client, rng, args.interactive_max_tokens)  # warm-up
    print(f"== idle interactive: {args.samples} requests", flush=True)
    idle = interactive_run(client, rng, args.interactive_max_tokens, lambda n: n < args.samples)
    print(f"== idle batch: {args.lines} lines", flush=True)
    watch = create(server, batch_requests(rng, "idle", args.lines, args.batch_max_tokens))
    watch.wait()
    idle_batch = batch_figures(watch) | {"output_tokens": output_tokens(client, watch.batch_id)}
    print(f"== loaded: {args.lines} lines and the interactive client", flush=True)
    watch = create(server, batch_requests(rng, "loaded", args.lines, args.batch_max_tokens))
    watch.wait(until=lambda: watch.first_running is not None)
    loaded = interactive_run(client, rng, args.interactive_max_tokens, lambda _: not watch.over)
    watch.wait()
    loaded_batch = batch_figures(watch) | {"output_tokens": output_tokens(client, watch.batch_id)}
    # The last request may outlast the batch: only those done while it ran count.
    during = [s for s in loaded if s.started + s.total <= watch.ended_seen]
    if len(during) < args.samples:
        print(f"  warning: only {len(during)} interactive requests ran beside the batch")
    print(f"== idle after: {args.samples} requests", flush=True)
    after = interactive_run(client, rng, args.interactive_max_tokens, lambda n: n < args.samples)
    return {
        "idle_interactive": latency(idle),
        "idle_batch": idle_batch,
        "loaded_interactive": latency(during),
        "loaded_batch": loaded_batch,
        "idle_after_interactive": latency(after),
        "samples": {
            "idle": [asdict(s) for s in idle],
            "loaded": [asdict(s) for s in loaded],  # the last may end after the batch
            "idle_after": [asdict(s) for s in after],
        },
    }


def line_states(db: Path, batch_id: str) -> dict[str, int]:
    """The batch's lines by state (and `run_again`: those started more than once), read from
    its SQLite file read-only."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        rows = conn.execute("SELECT state, attempts FROM lines WHERE batch_id = ?", (batch_id,))
        lines = rows.fetchall()
    states = collections.Counter(state for state, _ in lines)
    return dict(states) | {"run_again": sum(1 for _, attempts in lines if attempts > 1)}


def crash(args: argparse.Namespace, model: Path, state: Path) -> dict[str, Any]:
    print(f"== crash: {args.crash_lines} lines, kill -9 at {KILL_AT:.0%} done", flush=True)
    requests = batch_requests(random.Random(1), "crash", args.crash_lines, args.batch_max_tokens)
    batch_id, pids, before = kill_mid_batch(args, model, state, requests)
    print(f"  killed pids {pids}; lines then: {before}", flush=True)
    began = time.perf_counter()
    server = start(args, model, state, "crash-restart")
    try:
        ready = time.perf_counter() - began
        watch = Watch(server, batch_id).start()
        watch.wait()
        return crash_figures(server, watch, requests, before, pids) | {
            "restart_ready_s": ready,
            "restart_to_ended_s": time.perf_counter() - began,
        }
    finally:
        server.stop()


def kill_mid_batch(
    args: argparse.Namespace, model: Path, state: Path, requests: list[dict]
) -> tuple[str, list[int], dict[str, int]]:
    """Create the batch, kill -9 the server once KILL_AT of its lines are done: the batch id,
    the pids killed and the lines' states then."""
    server = start(args, model, state, "crash")
    try:
        watch = create(server, requests)
        target = max(1, int(KILL_AT * len(requests)))
        watch.wait(until=lambda: watch.done >= target)
        if watch.over:
            raise RuntimeError(f"the crash batch ended before {target} lines were done")
        watch.stop()
        pids = server.kill_group()
    finally:
        server.stop()  # (when killed, nothing left to stop)
    return watch.batch_id, pids, line_states(server.batches_db, watch.batch_id)


def crash_figures(
    server: BatchServer, watch: Watch, requests: list[dict], before: dict[str, int], pids: list[int]
) -> dict[str, Any]:
    seen: collections.Counter[str] = collections.Counter()
    types: collections.Counter[str] = collections.Counter()
    for entry in server.client().messages.batches.results(watch.batch_id):
        seen[entry.custom_id] += 1
        types[entry.result.type] += 1
    expected = {r["custom_id"] for r in requests}
    after = line_states(server.batches_db, watch.batch_id)
    done_before = sum(before.get(s, 0) for s in ("succeeded", "errored", "canceled", "expired"))
    return {
        "batch_id": watch.batch_id,
        "lines": len(requests),
        "killed_pids": pids,
        "lines_at_kill": before,
        "done_before_kill": done_before,
        "running_at_kill": before.get("running", 0),
        "results": sum(seen.values()),
        "result_types": dict(types),
        "duplicates": sum(n - 1 for n in seen.values() if n > 1),
        "missing": len(expected - set(seen)),
        "unexpected": len(set(seen) - expected),
        "errored": types["errored"],
        "not_succeeded": sum(seen.values()) - types["succeeded"],
        "run_again": after["run_again"],
        "request_counts": watch.ended.request_counts.model_dump(),
    }


# -- the report -----------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


INTERACTIVE_COLUMNS = ["samples", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms",
                       "total_p50_ms", "total_p90_ms", "ttft_p50_vs_idle", "tpot_p50_vs_idle",
                       "total_p50_vs_idle"]  # fmt: skip
BATCH_COLUMNS = ["lines", "seconds", "lines_per_min", "lines_per_min_vs_idle", "running_max",
                 "running_mean", "output_tokens"]  # fmt: skip
CRASH_COLUMNS = ["lines", "done_before_kill", "running_at_kill", "results", "duplicates",
                 "missing", "errored", "not_succeeded", "run_again"]  # fmt: skip


def add_ratios(report: dict[str, Any]) -> None:
    """Each run's figure over the idle one's, in the run's own entry."""
    for figure in ("ttft_p50", "tpot_p50", "total_p50"):
        idle = report["idle_interactive"][f"{figure}_ms"]
        for run in ("idle", "loaded", "idle_after"):
            entry = report[f"{run}_interactive"]
            entry[f"{figure}_vs_idle"] = ratio(entry[f"{figure}_ms"], idle)
    idle = report["idle_batch"]["lines_per_min"]
    for run in ("idle", "loaded"):
        entry = report[f"{run}_batch"]
        entry["lines_per_min_vs_idle"] = ratio(entry["lines_per_min"], idle)


def print_report(report: dict[str, Any]) -> None:
    print("\ninteractive, one streamed request at a time")
    rows = [
        [run, *(report[f"{run}_interactive"][k] for k in INTERACTIVE_COLUMNS)]
        for run in ("idle", "loaded", "idle_after")
    ]
    print_table(["run", *INTERACTIVE_COLUMNS], rows)
    print("\nbatches")
    rows = [
        [run, *(report[f"{run}_batch"][k] for k in BATCH_COLUMNS),
         _counts(report[f"{run}_batch"]["request_counts"])]
        for run in ("idle", "loaded")
    ]  # fmt: skip
    print_table(["run", *BATCH_COLUMNS, "request_counts"], rows)
    loaded = report["loaded_interactive"]
    lines = report["loaded_batch"]["lines_per_min_vs_idle"]
    print(f"\nloaded / idle: interactive TTFT p50 {_x(loaded['ttft_p50_vs_idle'])},", end=" ")
    print(f"TPOT p50 {_x(loaded['tpot_p50_vs_idle'])} (target <= 1.3x),", end=" ")
    print(f"answer p50 {_x(loaded['total_p50_vs_idle'])} (target <= 1.5x),", end=" ")
    print(f"batch lines/min {_x(lines)} (target >= 0.5x)")
    if crash := report.get("crash"):
        print("\ncrash: kill -9 of the server's process group, restart, results")
        print_table(CRASH_COLUMNS, [[crash[k] for k in CRASH_COLUMNS]])
        print(f"restart: ready in {crash['restart_ready_s']:.1f}s, batch ended"
              f" {crash['restart_to_ended_s']:.1f}s after the restart")  # fmt: skip


def _counts(counts: dict[str, int]) -> str:
    return " ".join(f"{k} {v}" for k, v in counts.items() if v)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model = model_path(args.model_dir)
    report: dict[str, Any] = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": str(model),
        "load_average": os.getloadavg(),
    }
    with tempfile.TemporaryDirectory(prefix="zerohop-batches-") as tmp:
        server = start(args, model, Path(tmp) / "main", "main")
        report["server_cmd"] = server.cmd
        try:
            report |= phases_1_to_3(args, server)
        finally:
            server.stop()
        if not args.skip_crash:
            report["crash"] = crash(args, model, Path(tmp) / "crash")
    report["load_average_after"] = os.getloadavg()
    add_ratios(report)
    print_report(report)
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
