"""Tenancy in the scheduler, measured on the real default model: fair share (VTC) against
arrival order (FCFS), tenant weights, interactive against batch, and the cost of refusing.

Each tenant has its own key in a fresh key store (`zerohop keys`); the server runs with
--max-num-seqs (16) sequences at a time, so a tenant that keeps 32 requests in flight
builds a waiting queue, which is where the policy matters. Prompts are 128 tokens of text;
every request streams from /v1/completions.

  idle          tenant B alone, one request at a time: TTFT p50 (the baseline)
  flood         tenant A keeps 32 long requests in flight; B sends one at a time: B's TTFT
                p50 under VTC and under FCFS (a server of each)
  weights       tenants of weight 1 and 2 each keep 32 requests in flight: the ratio of
                output tokens each received in the measured window (target 2, within 10%)
  batch         a batch-class key keeps 32 in flight; an interactive key sends one at a
                time: its TTFT p50 against idle
  refusals      a server whose queue is held full (--max-waiting 1): requests refused per
                second, and per second of the API process's CPU

    .venv/bin/python benchmarks/fairness.py [--max-num-seqs 16] [--window 40] [--threads 2]

Prints a table and writes bench-results/fairness.json; server logs go beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from _common import ROOT, TextPrompts, default_model, print_table, write_json
from serve import server_pids
from vs_llamacpp import CommandServer

MODEL = "default"
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
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--long-tokens", type=int, default=128, help="output of the flooding requests")
    p.add_argument("--probe-tokens", type=int, default=8, help="output of the one-at-a-time ones")
    p.add_argument("--probes", type=int, default=8, help="one-at-a-time requests per scenario")
    p.add_argument("--window", type=float, default=40.0, help="seconds measured for weights")
    p.add_argument("--refusals", type=int, default=2000)
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "fairness.json")
    return p.parse_args(argv)


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


@dataclass
class Result:
    status: int
    ttft: float | None = None
    token_times: list[float] = field(default_factory=list)
    error: str = ""


class Load:
    """Streaming completions through one connection pool; prompts of the model's own text."""

    def __init__(self, url: str, keys: dict[str, str], prompts: TextPrompts, args) -> None:
        self.url, self.keys, self.prompts, self.args = url, keys, prompts, args
        self.rng = random.Random(0)
        self.client: httpx.AsyncClient

    def run(self, method, *args):
        """`method(*args)` in a fresh event loop with its own connection pool."""

        async def go():
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
            async with httpx.AsyncClient(base_url=self.url, timeout=600, limits=limits) as c:
                self.client = c
                return await method(*args)

        return asyncio.run(go())

    async def request(self, key: str, max_tokens: int) -> Result:
        body = {
            "model": MODEL,
            "prompt": self.prompts.prompt(self.rng, self.args.prompt_tokens),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        headers = {"authorization": f"Bearer {self.keys[key]}"}
        start = time.monotonic()
        async with self.client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            result = Result(r.status_code)
            if r.status_code != 200:
                result.error = (await r.aread()).decode(errors="replace")
                return result
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    now = time.monotonic()
                    result.ttft = result.ttft if result.ttft is not None else now - start
                    result.token_times.append(now)
        return result

    async def keep_in_flight(self, key: str, count: int, stop: asyncio.Event) -> list[Result]:
        results: list[Result] = []

        async def loop() -> None:
            while not stop.is_set():
                try:
                    results.append(await self.request(key, self.args.long_tokens))
                except httpx.HTTPError as exc:
                    results.append(Result(0, error=repr(exc)))

        tasks = [asyncio.create_task(loop()) for _ in range(count)]
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return results

    async def probe(self, key: str) -> list[float]:
        ttfts = []
        for _ in range(self.args.probes):
            result = await self.request(key, self.args.probe_tokens)
            if result.status != 200 or result.ttft is None:
                raise RuntimeError(f"probe failed: {result.status} {result.error}")
            ttfts.append(result.ttft)
        return ttfts

    async def under(self, background: dict[str, int], probe_key: str) -> list[float]:
        """Probe TTFTs while `background` keys keep their request counts in flight."""
        stop = asyncio.Event()
        floods = [
            asyncio.create_task(self.keep_in_flight(k, n, stop)) for k, n in background.items()
        ]
        await asyncio.sleep(5.0)  # let the queue build
        ttfts = await self.probe(probe_key)
        stop.set()
        await asyncio.gather(*floods)
        return ttfts

    async def weighted(self) -> dict[str, float]:
        stop = asyncio.Event()
        runs = {
            k: asyncio.create_task(self.keep_in_flight(k, 32, stop)) for k in ("light", "heavy")
        }
        await asyncio.sleep(10.0)  # warm-up: both backlogged
        start = time.monotonic()
        await asyncio.sleep(self.args.window)
        end = time.monotonic()
        stop.set()
        tokens = {}
        for key, task in runs.items():
            results = await task
            tokens[key] = sum(start <= t < end for r in results for t in r.token_times)
        return {**tokens, "ratio": tokens["heavy"] / max(1, tokens["light"])}


def p50(values: list[float]) -> float:
    return statistics.median(values) * 1000


def serve(policy: str, args, db: Path, log_dir: Path, extra: list[str] = ()) -> CommandServer:
    cmd = [
        sys.executable, "-m", "zerohop", "serve", "--keys-db", str(db), "--served-model-name",
        MODEL, "--num-threads", str(args.threads), "--grpc-port", "0",
        "--scheduling-policy", policy, "--max-num-seqs", str(args.max_num_seqs), *extra,
    ]  # fmt: skip
    return CommandServer(cmd, "/ready", log_dir / f"fairness-{policy}-server.log")


async def refusal_cost(url: str, keys: dict[str, str], api_pid: int, args) -> dict:
    """Hold the queue full with long requests, then time a burst of refused ones."""
    headers = {"authorization": f"Bearer {keys['chat']}"}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        long = {"model": MODEL, "prompt": "hold", "max_tokens": 100000, "ignore_eos": True}
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

        cpu_start, start = _cpu_seconds(api_pid), time.monotonic()
        await asyncio.gather(*(worker() for _ in range(32)))
        wall, cpu = time.monotonic() - start, _cpu_seconds(api_pid) - cpu_start
        for hold in holds:
            hold.cancel()
        await asyncio.gather(*holds, return_exceptions=True)
    refused = statuses.count(503)
    return {
        "refused": refused,
        "other": len(statuses) - refused,
        "per_second": refused / wall,
        "api_cpu_seconds": cpu,
        "per_cpu_second": refused / cpu if cpu > 0 else None,
    }


def _cpu_seconds(pid: int) -> float:
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(args: argparse.Namespace) -> dict:
    from zerohop.engine.checkpoint import open_checkpoint

    prompts = TextPrompts.for_tokenizer(open_checkpoint(default_model()).tokenizer())
    log_dir = args.out.parent
    report: dict = {"max_num_seqs": args.max_num_seqs, "threads": args.threads}
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "keys.db"
        keys = make_keys(db)
        with serve("vtc", args, db, log_dir) as server:
            load = Load(server.url, keys, prompts, args)
            report["idle_ttft_ms"] = p50(load.run(load.probe, "probe"))
            print(f"  idle: TTFT p50 {report['idle_ttft_ms']:.0f} ms")
            report["vtc_flood_ttft_ms"] = p50(load.run(load.under, {"flood": 32}, "probe"))
            print(f"  flood, VTC: B's TTFT p50 {report['vtc_flood_ttft_ms']:.0f} ms")
            report["batch_ttft_ms"] = p50(load.run(load.under, {"bulk": 32}, "chat"))
            print(f"  batch flood: interactive TTFT p50 {report['batch_ttft_ms']:.0f} ms")
            report["weights"] = load.run(load.weighted)
            print(f"  weights 1:2: output tokens {report['weights']}")
        with serve("fcfs", args, db, log_dir) as server:
            load = Load(server.url, keys, prompts, args)
            report["fcfs_flood_ttft_ms"] = p50(load.run(load.under, {"flood": 32}, "probe"))
            print(f"  flood, FCFS: B's TTFT p50 {report['fcfs_flood_ttft_ms']:.0f} ms")
        extra = ["--max-waiting", "1", "--max-num-seqs", "1"]
        with serve("vtc", args, db, log_dir, extra) as server:
            api_pid = server_pids(server.process.pid)["api"]
            report["refusals"] = asyncio.run(refusal_cost(server.url, keys, api_pid, args))
            print(f"  refusals: {report['refusals']}")
    return report


def print_report(report: dict) -> None:
    idle = report["idle_ttft_ms"]
    refusals = report["refusals"]
    rows = [
        ["B's TTFT p50, idle", f"{idle:.0f} ms", "1.00x"],
        ["B's TTFT p50, A flooding, VTC", f"{report['vtc_flood_ttft_ms']:.0f} ms",
         f"{report['vtc_flood_ttft_ms'] / idle:.2f}x idle (target <= 2)"],
        ["B's TTFT p50, A flooding, FCFS", f"{report['fcfs_flood_ttft_ms']:.0f} ms",
         f"{report['fcfs_flood_ttft_ms'] / idle:.2f}x idle"],
        ["interactive TTFT p50, batch flooding", f"{report['batch_ttft_ms']:.0f} ms",
         f"{report['batch_ttft_ms'] / idle:.2f}x idle (target <= 2)"],
        ["output tokens, weight 2 : weight 1", f"{report['weights']['ratio']:.2f}",
         "target 2.00 +- 10%"],
        ["overload refusals", f"{refusals['per_second']:.0f} /s",
         f"{refusals['per_cpu_second'] or 0:.0f} per API CPU second"],
    ]  # fmt: skip
    print_table(["measure", "value", "against"], rows)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    report = run(args)
    print_report(report)
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
