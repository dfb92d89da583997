"""Tenancy in the scheduler, measured on a real model: fair share (VTC) against arrival order
(FCFS), tenant weights, interactive against batch, and the cost of refusing, on zerohop's engine
or on vLLM's (`--engine vllm`: vLLM's engine inside zerohop, fair share running in vLLM's
scheduler as its scheduler class).

Each tenant has its own key in a fresh key store (`zerohop keys`); the server runs with
--max-num-seqs (16) sequences at a time, so a tenant that keeps 32 requests in flight
builds a waiting queue, which is where the policy matters. `--max-num-seqs 0` and
`--threads 0` leave the server's own defaults; `--defaults` sets both (the issue's target is
at the server defaults, where 32 streams all run at once), and the flags passed are printed
and kept in the JSON. Prompts are 128 tokens of text; every request streams from
/v1/completions.

  idle          tenant B alone, one request at a time: TTFT p50 (the baseline)
  flood         tenant A keeps 32 long requests in flight; B sends one at a time: B's TTFT
                p50 under VTC (and as a ratio to idle; target <= 2x), and A's inter-token
                latency p50/p99 from its streams' chunk arrival times, each stream's first
                token excluded, while B's probes run (target p99 <= 150 ms) and over the
                whole flood
  weights       tenants of weight 1 and 2 each keep 32 requests in flight (outputs of 16-64
                tokens, so they do not end in step): the ratio of output tokens the server
                served each in the measured window (/metrics; target 2, within 10%), on a server
                with --max-queue-wait 0 (the engine's shares, not admission)
  batch         a batch-class key keeps 32 in flight; an interactive key sends one at a
                time: its TTFT p50 against idle
  fcfs          flood on a server with --scheduling-policy fcfs: B's TTFT p50
  refusals      a server whose queue is held full (--max-waiting 1): requests refused per
                second, and per second of the API process's CPU

    .venv/bin/python benchmarks/fairness.py [--engine zerohop|vllm] [--defaults]
        [--model default|tiny|standard|PATH] [--max-num-seqs 16] [--window 40] [--threads 2]

--model: default (zerohop's default GGUF), tiny, standard (_common.py's 12-layer random Llama)
or a .gguf file / HF folder. --threads and --max-num-seqs (0: the server's default) set the
server's --num-threads and --max-num-seqs. With --engine vllm, --enforce-eager is passed on CPU
(torch.compile takes minutes on 2 cores) unless --no-enforce-eager. Prints a table and writes
bench-results/fairness.json (every server's flags, the figures, the targets met or not, each
phase's seconds); server logs go beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
from _common import ROOT, TextPrompts, model_path, open_model, print_table, write_json
from _procstat import process_cpu_s
from _tenant_load import Load, gap_figures, p50
from harness.zerohop_server import ZerohopServer

MODEL = "default"
FLOOD_STREAMS = 32
TTFT_RATIO_TARGET = 2.0  # light tenant's TTFT p50 under the flood, over idle
INTER_TOKEN_P99_TARGET_MS = 150.0  # the flood's inter-token p99 meanwhile
DEFAULT_MAX_NUM_SEQS, DEFAULT_THREADS = 16, 2  # this benchmark's, unless --defaults
KEYS = {  # name: (tenant, weight, priority)
    "flood": ("tenant-a", 1.0, "interactive"),
    "probe": ("tenant-b", 1.0, "interactive"),
    "light": ("light", 1.0, "interactive"),
    "heavy": ("heavy", 2.0, "interactive"),
    "bulk": ("bulk", 1.0, "batch"),
    "chat": ("chat", 1.0, "interactive"),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engine", choices=("zerohop", "vllm"), default="zerohop")
    p.add_argument("--model", default="default", help="default, tiny, standard or a path")
    p.add_argument("--defaults", action="store_true", help="--max-num-seqs 0 --threads 0")
    p.add_argument("--threads", type=int, default=None, help=f"(default {DEFAULT_THREADS})")
    p.add_argument("--max-num-seqs", type=int, default=None, help=f"({DEFAULT_MAX_NUM_SEQS})")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--long-tokens", type=int, default=128, help="output of the flooding requests")
    p.add_argument("--probe-tokens", type=int, default=8, help="output of the one-at-a-time ones")
    p.add_argument("--probes", type=int, default=8, help="one-at-a-time requests per scenario")
    p.add_argument("--warmups", type=int, default=1, help="unmeasured requests on a new server")
    p.add_argument("--window", type=float, default=60.0, help="seconds measured for weights")
    p.add_argument("--refusals", type=int, default=2000)
    p.add_argument("--only", default=None, help="comma-separated scenarios (default: all)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for a server")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "fairness.json")
    args = p.parse_args(argv)
    if args.defaults:
        if args.max_num_seqs or args.threads:
            p.error("--defaults leaves --max-num-seqs and --threads to the server")
        args.max_num_seqs = args.threads = 0
    args.max_num_seqs = DEFAULT_MAX_NUM_SEQS if args.max_num_seqs is None else args.max_num_seqs
    args.threads = DEFAULT_THREADS if args.threads is None else args.threads
    if args.enforce_eager is None:
        args.enforce_eager = args.engine == "vllm" and not on_cuda()
    args.scenarios = [s.strip() for s in args.only.split(",")] if args.only else list(SCENARIOS)
    if unknown := sorted(set(args.scenarios) - set(SCENARIOS)):
        p.error(f"--only: unknown {', '.join(unknown)} (of {', '.join(SCENARIOS)})")
    return args


def on_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def make_keys(db: Path) -> dict[str, str]:
    zerohop = [sys.executable, "-m", "zerohop", "keys"]
    secrets = {}
    for name, (tenant, weight, priority) in KEYS.items():
        run = [*zerohop, "tenant", tenant, "--weight", str(weight), "--keys-db", str(db)]
        subprocess.run(run, check=True, capture_output=True)
        create = [*zerohop, "create", "--tenant", tenant, "--priority", priority, "--json"]
        out = subprocess.run([*create, "--keys-db", str(db)], check=True, capture_output=True)
        secrets[name] = json.loads(out.stdout)["key"]
    return secrets


def server_flags(args: argparse.Namespace, policy: str, extra: Sequence[str] = ()) -> list[str]:
    """`zerohop serve`'s flags beyond the plumbing (keys, model name, ports): only those that
    differ from the server's defaults."""
    flags = ["--engine", args.engine]
    if policy != "vtc":
        flags += ["--scheduling-policy", policy]
    if args.max_num_seqs:
        flags += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.threads:
        flags += ["--num-threads", str(args.threads)]
    if args.enforce_eager:
        flags.append("--enforce-eager")
    return [*flags, *extra]


def serve(
    label: str, policy: str, args, db: Path, log_dir: Path, extra: Sequence[str] = ()
) -> ZerohopServer:
    """A fairness server, ready within --start-timeout (vLLM's engine takes longer to start
    than zerohop's, more so on a busy machine)."""
    model = None if args.model == "default" else args.model_path
    flags = ["--keys-db", str(db), *server_flags(args, policy, extra)]
    log = log_dir / f"fairness-{args.engine}-{label}-server.log"
    return ZerohopServer(model, flags, log, timeout=args.start_timeout, served_name=MODEL)


async def refusal_cost(url: str, keys: dict[str, str], api_pid: int, args) -> dict:
    """Hold the queue full with long requests, then time a burst of refused ones."""
    headers = {"authorization": f"Bearer {keys['chat']}"}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        long = {"model": MODEL, "prompt": "hold", "max_tokens": 4000, "ignore_eos": True}
        holds = [
            asyncio.create_task(client.post("/v1/completions", json=long, headers=headers))
            for _ in range(2)
        ]
        await asyncio.sleep(3.0)
        small = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        queue = asyncio.Queue()
        for _ in range(args.refusals):
            queue.put_nowait(None)
        statuses: list[int] = []

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                r = await client.post("/v1/completions", json=small, headers=headers)
                statuses.append(r.status_code)

        cpu_start, start = process_cpu_s(api_pid), time.monotonic()
        await asyncio.gather(*(worker() for _ in range(32)))
        wall, cpu = time.monotonic() - start, process_cpu_s(api_pid) - cpu_start
        for hold in holds:
            hold.cancel()
        await asyncio.gather(*holds, return_exceptions=True)
    refused = statuses.count(503)
    return {
        "refused": refused,
        "statuses": {str(k): v for k, v in sorted(Counter(statuses).items())},
        "per_second": refused / wall,
        "api_cpu_seconds": cpu,
        "per_cpu_second": refused / cpu if cpu > 0 else None,
    }


SCENARIOS = ("idle", "flood", "batch", "weights", "fcfs", "refusals")


def target(value: float | None, limit: float) -> dict:
    return {"value": value, "target": limit, "met": value is not None and value <= limit}


def run(args: argparse.Namespace) -> dict:
    wanted = set(args.scenarios)
    args.model_path = model_path(None if args.model == "default" else args.model)
    prompts = TextPrompts.for_tokenizer(open_model(args.model_path)[1])
    log_dir = args.out.parent
    report: dict = {
        "engine": args.engine, "model": args.model, "model_path": str(args.model_path),
        "defaults": args.defaults, "max_num_seqs": args.max_num_seqs or None,
        "threads": args.threads or None, "enforce_eager": args.enforce_eager,
        "flood_streams": FLOOD_STREAMS, "prompt_tokens": args.prompt_tokens,
        "long_tokens": args.long_tokens, "probe_tokens": args.probe_tokens,
        "probes": args.probes, "servers": {}, "seconds": {},
    }  # fmt: skip
    left = [f for f, v in (("--max-num-seqs", args.max_num_seqs), ("--num-threads", args.threads))
            if not v]  # fmt: skip
    print(f"engine {args.engine}, model {args.model} ({args.model_path})")
    print(f"  server flags: {' '.join(server_flags(args, 'vtc'))}"
          f"{'; left to the server: ' + ', '.join(left) if left else ''}")  # fmt: skip
    seconds = report["seconds"]

    def note(key: str, value: object) -> None:
        report[key] = value
        print(f"  {key}: {value}", flush=True)

    @contextlib.contextmanager
    def server(label: str, policy: str = "vtc", extra: Sequence[str] = ()) -> Iterator[Load]:
        flags = server_flags(args, policy, extra)
        start = time.monotonic()
        with serve(label, policy, args, db, log_dir, extra) as running:
            seconds[f"start_{label}"] = time.monotonic() - start
            report["servers"][label] = {"flags": flags, "command": running.cmd[2:]}
            load = Load(running.url, keys, prompts, args)
            load.server = running
            load.run(load.warm_up, "chat")
            yield load
        seconds[f"server_{label}"] = time.monotonic() - start

    def timed(name: str, load: Load, method, *method_args):
        start = time.monotonic()
        value = load.run(method, *method_args)
        seconds[name] = time.monotonic() - start
        return value

    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "keys.db"
        keys = make_keys(db)
        if wanted & {"idle", "flood", "batch"}:
            with server("vtc") as load:
                if "idle" in wanted:
                    note("idle_ttft_ms", p50(timed("idle", load, load.probe, "probe")))
                if "flood" in wanted:
                    flood = timed("flood", load, load.under, {"flood": FLOOD_STREAMS}, "probe")
                    note("vtc_flood_ttft_ms", p50(flood))
                    note("vtc_flood_inter_token_ms", gap_figures(load.gaps))
                    note("vtc_flood_inter_token_all_ms", gap_figures(load.all_gaps))
                if "batch" in wanted:
                    batch = timed("batch", load, load.under, {"bulk": FLOOD_STREAMS}, "chat")
                    note("batch_ttft_ms", p50(batch))
        if "weights" in wanted:  # shares of the engine alone: no overload refusals
            with server("weights", "vtc", ["--max-queue-wait", "0"]) as load:
                note("weights", timed("weights", load, load.weighted))
        if "fcfs" in wanted:
            with server("fcfs", "fcfs") as load:
                fcfs = timed("fcfs", load, load.under, {"flood": FLOOD_STREAMS}, "probe")
                note("fcfs_flood_ttft_ms", p50(fcfs))
        if "refusals" in wanted:
            extra = ["--max-waiting", "1", "--max-num-seqs", "1"]
            with server("refusals", "vtc", extra) as load:
                assert load.server is not None
                api_pid = load.server.api_pid()
                start = time.monotonic()
                note("refusals", asyncio.run(refusal_cost(load.url, keys, api_pid, args)))
                seconds["refusals"] = time.monotonic() - start
    report["targets"] = targets(report)
    return report


def targets(report: dict) -> dict:
    """The issue's targets, each met or not: the light tenant's TTFT p50 under the flood
    within 2x idle and the flood's inter-token p99 (during the probes) within 150 ms; the
    interactive TTFT beside a batch flood within 2x idle too."""
    out = {}
    idle = report.get("idle_ttft_ms")
    if idle and "vtc_flood_ttft_ms" in report:
        ratio = report["vtc_flood_ttft_ms"] / idle
        out["flood_ttft_ratio"] = target(ratio, TTFT_RATIO_TARGET)
        p99 = report["vtc_flood_inter_token_ms"]["p99"]
        out["flood_inter_token_p99_ms"] = target(p99, INTER_TOKEN_P99_TARGET_MS)
    if idle and "batch_ttft_ms" in report:
        out["batch_ttft_ratio"] = target(report["batch_ttft_ms"] / idle, TTFT_RATIO_TARGET)
    return out


def met(figure: dict) -> str:
    return "met" if figure["met"] else "NOT met"


def print_report(report: dict) -> None:
    idle = report.get("idle_ttft_ms")
    goals = report.get("targets", {})
    rows = [["TTFT p50, idle", f"{idle:.0f} ms", ""]] if idle else []
    for key, label, goal in (
        ("vtc_flood_ttft_ms", "B's TTFT p50, A flooding, VTC (target <= 2x idle)",
         "flood_ttft_ratio"),
        ("fcfs_flood_ttft_ms", "B's TTFT p50, A flooding, FCFS", None),
        ("batch_ttft_ms", "interactive TTFT p50, batch flooding (target <= 2x idle)",
         "batch_ttft_ratio"),
    ):  # fmt: skip
        if key in report:
            ratio = f"{report[key] / idle:.2f}x idle" if idle else ""
            if goal in goals:
                ratio += f": {met(goals[goal])}"
            rows.append([label, f"{report[key]:.0f} ms", ratio])
    for key, when in (("vtc_flood_inter_token_ms", "during B's probes"),
                      ("vtc_flood_inter_token_all_ms", "whole flood")):  # fmt: skip
        gaps = report.get(key)
        if not gaps:
            continue
        if gaps["gaps"] == 0:
            rows.append([f"A's inter-token p50 / p99 / max, {when}", "no gaps", ""])
            continue
        note = f"{gaps['gaps']} gaps"
        if key == "vtc_flood_inter_token_ms" and "flood_inter_token_p99_ms" in goals:
            note += f"; p99 <= 150 ms: {met(goals['flood_inter_token_p99_ms'])}"
        rows.append([f"A's inter-token p50 / p99 / max, {when}", f"{gaps['p50']:.0f} /"
                     f" {gaps['p99']:.0f} / {gaps['max']:.0f} ms", note])  # fmt: skip
    if "weights" in report:
        w = report["weights"]
        served = w["server_output_tokens"]
        rows.append(["output tokens served, weight 2 : weight 1 (target 2 +- 10%)",
                     f"{w['ratio']:.2f}", f"{served['heavy']:.0f} : {served['light']:.0f}"
                     f" (client's count: {w['client_ratio']:.2f})"])  # fmt: skip
    if "refusals" in report:
        r = report["refusals"]
        rows.append(["overload refusals", f"{r['per_second']:.0f} /s",
                     f"{r['per_cpu_second'] or 0:.0f} per API-process CPU second"])  # fmt: skip
    print(f"\nengine {report['engine']}, model {report['model']}, server flags:"
          f" {' '.join(report['servers'].get('vtc', {}).get('flags', []))}")  # fmt: skip
    print_table(["measure", "value", ""], rows)
    print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in report["seconds"].items()))


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    report = run(args)
    print_report(report)
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
