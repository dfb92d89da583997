"""What the operator's console costs the requests it watches, side by side in one run.

Served: one `zerohop serve` (the default model unless --model-dir names another) with keys,
audit and the admin API (and no prefix cache, so that every run's prompts cost the same),
driven by `zerohop bench`'s client (OpenAI /v1/completions,
streaming, --concurrency streams, --input-tokens -> --output-tokens) twice per round, in
alternating order:
  closed  nobody looks;
  open    --viewers console tabs, each as the browser does it every second: the overview's
          `GET /v1/admin/live?seconds=900&since=T` and the usage page's today's usage report
          plus `GET /v1/admin/budgets`, with an admin key (the first poll of each tab fetches
          the whole 15 minutes).
Each figure counts at its best round (a shared machine only slows a run down); the ratios
open / closed are the result: output throughput, TTFT p50/p99, inter-token p50/p99, and the
API process's CPU per request.

In process: the operator parts each request pays for, timeit best of 5 over --requests
requests of --output-tokens tokens: `UsageRecorder.record`, `LiveLoad.on_finished` and the
per-token `LiveLoad.on_tokens`, and per second `LiveLoad.sample` and the window answers.

    .venv/bin/python benchmarks/console.py [--repeats 3] [--out bench-results/console.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
import timeit
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import ROOT, cpu_count, model_path, print_table, write_json
from harness.zerohop_server import ZerohopServer
from serve import CpuMeter, load_config, prompt_maker

from zerohop.api.load.live_load import LiveLoad
from zerohop.bench.load import run_benchmark
from zerohop.gateway.gateway import Call
from zerohop.gateway.keys.identity import Identity, Tenant
from zerohop.gateway.store.sqlite import KeyStore
from zerohop.gateway.store.store import Store
from zerohop.gateway.usage import UsageRecorder

MODES = ("closed", "open")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", default=None, help="default: zerohop's default model")
    p.add_argument("--threads", type=int, default=1, help="engine torch threads")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--viewers", type=int, default=2, help="console tabs open in the open runs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=2000, help="in-process timing requests")
    p.add_argument("--kv-cache-memory", type=float, default=1.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "console.json")
    return p.parse_args(argv)


# -- served ---------------------------------------------------------------------------------------


class ConsoleTab:
    """What one open console tab asks each second (overview + usage), from a thread."""

    def __init__(self, url: str, admin_key: str) -> None:
        self.url, self.key = url, admin_key
        self.seconds: list[float] = []
        self.errors = 0
        self._since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _get(self, path: str) -> Any:
        request = urllib.request.Request(self.url + path, headers={"x-api-key": self.key})
        with urllib.request.urlopen(request, timeout=10) as answer:
            return json.loads(answer.read())

    def _poll(self) -> None:
        since = "" if self._since is None else f"&since={self._since}"
        live = self._get(f"/v1/admin/live?seconds=900{since}")
        if live["t"]:
            self._since = live["t"][-1]
        today = time.strftime("%Y-%m-%dT00:00:00Z", time.gmtime())
        self._get(
            "/v1/organizations/usage_report/messages?bucket_width=1d&limit=31"
            f"&group_by[]=workspace_id&group_by[]=api_key_id&starting_at={today}"
        )
        self._get("/v1/admin/budgets")

    def _run(self) -> None:
        while True:
            start = time.perf_counter()
            try:
                self._poll()
                self.seconds.append(time.perf_counter() - start)
            except OSError:
                self.errors += 1
            if self._stop.wait(max(0.0, 1.0 - (time.perf_counter() - start))):
                return

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"polls": len(self.seconds), "errors": self.errors}


def make_keys(db: Path) -> tuple[str, str]:
    store = KeyStore(db)
    try:
        data, _ = store.create_key("bench", name="load")
        admin, _ = store.create_key("ops", name="console", admin=True, inference=False)
    finally:
        store.close()
    return data, admin


def served(args: argparse.Namespace, model: Path, work: Path) -> list[dict]:
    data_key, admin_key = make_keys(work / "keys.db")
    # No prefix cache: each run's prompts then cost the same, whichever seed made them.
    flags = ["--keys-db", str(work / "keys.db"), "--audit-dir", str(work / "audit"),
             "--no-prefix-caching"]  # fmt: skip
    flags += ["--num-threads", str(args.threads), "--max-num-seqs", "64"]
    flags += ["--kv-cache-memory", str(args.kv_cache_memory)]
    flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    rounds = []
    with ZerohopServer(model, flags, args.out.parent / "console-server.log") as server:
        warm_up(args, server, data_key)
        for rep in range(args.repeats):
            runs = {}
            for turn, mode in enumerate(MODES if rep % 2 == 0 else MODES[::-1]):
                cfg = load_config(
                    args, server.url, api_key=data_key, concurrency=args.concurrency,
                    requests=args.num_requests, output_tokens=args.output_tokens,
                    seed=rep * 10 + turn,  # by turn, not mode: both modes get both seeds
                )  # fmt: skip
                tabs = [ConsoleTab(server.url, admin_key) for _ in range(args.viewers)]
                if mode == "closed":
                    for tab in tabs:
                        tab.stop()
                    tabs = []
                runs[mode] = measure(server, cfg)
                runs[mode]["tabs"] = [tab.stop() for tab in tabs]
                r = runs[mode]
                print(f"  round {rep + 1} {mode:<6}: {r['output_throughput']:.1f} out tok/s,"
                      f" TTFT p50 {r['ttft_p50_ms']:.1f} ms, ITL p99 {r['itl_p99_ms']:.1f} ms,"
                      f" API CPU {r['api_cpu_ms_per_request']:.2f} ms/request,"
                      f" {r['failed']} failed, tabs {r['tabs']}", flush=True)  # fmt: skip
            rounds.append(runs)
    return rounds


def warm_up(args: argparse.Namespace, server: ZerohopServer, key: str) -> None:
    cfg = load_config(
        args, server.url, api_key=key, concurrency=args.concurrency, requests=args.concurrency,
        output_tokens=8, seed=999,
    )  # fmt: skip
    if run_benchmark(cfg)["summary"]["failed"]:
        raise RuntimeError(f"warm-up requests failed; log: {server.log}")


def measure(server: ZerohopServer, cfg: Any) -> dict:
    """One load run: what its client saw, and the API process's CPU per request."""
    cpu = CpuMeter(server)
    s = run_benchmark(cfg)["summary"]
    requests = s["completed"] + s["failed"] + cfg.warmup_requests
    used = cpu.stop(requests)
    return {
        "output_throughput": s["output_throughput"], "failed": s["failed"],
        "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
        "itl_p50_ms": s["itl_ms"]["p50"], "itl_p99_ms": s["itl_ms"]["p99"],
        "api_cpu_ms_per_request": 1000 * used["api_s"] / requests,
    }  # fmt: skip


def best(rounds: list[dict], mode: str, key: str, lowest: bool) -> float:
    values = [r[mode][key] for r in rounds]
    return min(values) if lowest else max(values)


def served_summary(rounds: list[dict]) -> list[list[Any]]:
    rows = []
    for key, lowest in (("output_throughput", False), ("ttft_p50_ms", True),
                        ("ttft_p99_ms", True), ("itl_p50_ms", True), ("itl_p99_ms", True),
                        ("api_cpu_ms_per_request", True)):  # fmt: skip
        closed, opened = best(rounds, "closed", key, lowest), best(rounds, "open", key, lowest)
        rows.append([key, f"{closed:.2f}", f"{opened:.2f}", f"{opened / closed:.3f}"])
    return rows


# -- in process -----------------------------------------------------------------------------------


def finished(i: int, output: int) -> Call:
    call = Call(f"req_{i}", "openai", identity=Identity(f"zh-k{i % 50:07d}", Tenant(f"t{i % 10}")))
    call.model, call.decision, call.status = "m", "admitted", 200
    call.prompt_tokens, call.cached_tokens, call.output_tokens = 128, 0, output
    call.first_token_at = call.started + 0.05
    call.token_times = [call.started + 0.05 + 0.01 * k for k in range(output)]
    return call


def in_process(args: argparse.Namespace, work: Path) -> dict[str, float]:
    calls = [finished(i, args.output_tokens) for i in range(args.requests)]
    recorder = UsageRecorder(Store(lambda: KeyStore(work / "inproc.db")).usage)
    live = LiveLoad()
    n = len(calls)

    def per_request(body: Callable[[], None]) -> float:
        return min(timeit.repeat(body, number=1, repeat=5)) / n * 1e6

    def tokens() -> None:
        for call in calls:
            for _ in range(args.output_tokens):
                live.on_tokens(call.identity.tenant.name, 1)

    def finish() -> None:
        for call in calls:
            live.on_finished(call.identity.tenant.name, 200, 128, 0, 0.05, call.token_times)

    out = {
        "usage_record_us": per_request(lambda: [recorder.record(c) for c in calls]),
        "live_on_finished_us": per_request(finish),
        "live_on_tokens_us_per_request": per_request(tokens),
    }
    t0 = time.time() - 900
    for second in range(900):  # a full ring of busy seconds, the last 15 minutes
        finish()
        live.sample({"num_blocks": 100, "blocks_in_use": 10, "num_running": 8,
                     "num_waiting": 0, "prefix_query_tokens": second,
                     "prefix_hit_tokens": 0}, t0 + second)  # fmt: skip
    out["live_sample_us"] = min(timeit.repeat(lambda: live.sample(None), number=1, repeat=5)) * 1e6
    out["window_900_ms"] = min(timeit.repeat(lambda: live.window(900), number=1, repeat=5)) * 1e3
    last = live.window(2)["t"][0]
    out["window_since_ms"] = (
        min(timeit.repeat(lambda: live.window(900, since=last), number=1, repeat=5)) * 1e3
    )
    recorder.close()
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    model = model_path(args.model_dir)
    args.prompt_source = prompt_maker(model)
    work = Path(tempfile.mkdtemp(prefix="zerohop-console-bench-"))
    report: dict[str, Any] = {"model": str(model), "cpus": cpu_count()}
    print("== in process: the operator parts per request", flush=True)
    report["in_process"] = in_process(args, work)
    print_table(["part", "cost"], [[k, f"{v:.2f}"] for k, v in report["in_process"].items()])
    print(f"== served: console closed vs {args.viewers} tabs open", flush=True)
    report["rounds"] = served(args, model, work)
    rows = served_summary(report["rounds"])
    print_table(["figure (best round)", "closed", "open", "open / closed"], rows)
    report["summary"] = {row[0]: {"closed": float(row[1]), "open": float(row[2]),
                                  "ratio": float(row[3])} for row in rows}  # fmt: skip
    report["args"] = {k: str(v) for k, v in vars(args).items() if k != "prompt_source"}
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
