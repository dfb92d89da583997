"""Tenancy in the scheduler, measured on the real default model: fair share (VTC) against
arrival order (FCFS), tenant weights, interactive against batch, and the cost of refusing.

Each tenant has its own key in a fresh key store (`zerohop keys`); the server runs with
--max-num-seqs (16) sequences at a time, so a tenant that keeps 32 requests in flight
builds a waiting queue, which is where the policy matters. Prompts are 128 tokens of text;
every request streams from /v1/completions.

  idle          tenant B alone, one request at a time: TTFT p50 (the baseline)
  flood         tenant A keeps 32 long requests in flight; B sends one at a time: B's TTFT
                p50 under VTC and under FCFS (a server of each)
  weights       tenants of weight 1 and 2 each keep 32 requests in flight (outputs of 16-64
                tokens, so they do not end in step): the ratio of output tokens the server
                served each in the measured window (/metrics; target 2, within 10%), on a server
                with --max-queue-wait 0 (the engine's shares, not admission)
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
import itertools
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from _common import ROOT, TextPrompts, default_model, print_table, write_json
from _procstat import process_cpu_s
from serve import server_pids
from vs_llamacpp import CommandServer

from zerohop import sse

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
    p.add_argument("--window", type=float, default=60.0, help="seconds measured for weights")
    p.add_argument("--refusals", type=int, default=2000)
    p.add_argument("--only", default=None, help="comma-separated scenarios (default: all)")
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
    retry_after: float = 0.0


class Load:
    """Streaming completions through one connection pool; prompts of the model's own text."""

    def __init__(self, url: str, keys: dict[str, str], prompts: TextPrompts, args) -> None:
        self.url, self.keys, self.prompts, self.args = url, keys, prompts, args
        self.rng = random.Random(0)
        self.client: httpx.AsyncClient
        self.gaps: list[float] = []  # the background streams' gaps during the last `under`

    def run(self, method, *args):
        """`method(*args)` in a fresh event loop with its own connection pool."""

        async def go():
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
            async with httpx.AsyncClient(base_url=self.url, timeout=600, limits=limits) as c:
                self.client = c
                return await method(*args)

        return asyncio.run(go())

    async def request(self, key: str, max_tokens: int, sink: list[Result] | None = None) -> Result:
        """One streamed completion; `sink` gets its Result at once, so a request cancelled
        mid-stream still shows the tokens it had."""
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
            if sink is not None:
                sink.append(result)
            if r.status_code != 200:
                result.error = (await r.aread()).decode(errors="replace")
                result.retry_after = float(r.headers.get("retry-after", 0))
                return result
            async for event in sse.aevents(r.aiter_bytes()):
                if (event.data or b"").startswith(b"{"):
                    now = time.monotonic()
                    result.ttft = result.ttft if result.ttft is not None else now - start
                    result.token_times.append(now)
        return result

    async def keep_in_flight(
        self, key: str, count: int, stop: asyncio.Event, lengths: tuple[int, int] | None = None
    ) -> list[Result]:
        """`count` requests of `key` in flight until `stop`: each --long-tokens long, or of a
        length drawn from `lengths` (which keeps them from ending all at once)."""
        results: list[Result] = []

        def length() -> int:
            return self.args.long_tokens if lengths is None else self.rng.randint(*lengths)

        async def loop() -> None:
            while not stop.is_set():
                try:
                    await self.request(key, length(), results)
                except httpx.HTTPError as exc:
                    results.append(Result(0, error=repr(exc)))
                await asyncio.sleep(results[-1].retry_after)  # as the SDKs do on 503/529

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
        """Probe TTFTs while `background` keys keep their request counts in flight; the
        background streams' gaps between tokens during the probes go to `self.gaps`."""
        stop = asyncio.Event()
        floods = [
            asyncio.create_task(self.keep_in_flight(k, n, stop)) for k, n in background.items()
        ]
        await asyncio.sleep(5.0)  # let the queue build
        start = time.monotonic()
        ttfts = await self.probe(probe_key)
        end = time.monotonic()
        stop.set()
        results = [r for flood in await asyncio.gather(*floods) for r in flood]
        self.gaps = [
            later - earlier
            for r in results
            for earlier, later in itertools.pairwise(r.token_times)
            if start <= earlier and later <= end
        ]
        return ttfts

    async def weighted(self) -> dict[str, float]:
        stop = asyncio.Event()
        lengths = (self.args.long_tokens // 8, self.args.long_tokens // 2)
        runs = {
            k: asyncio.create_task(self.keep_in_flight(k, 32, stop, lengths))
            for k in ("light", "heavy")
        }
        await asyncio.sleep(10.0)  # warm-up: both backlogged
        start, before = time.monotonic(), await self.served_tokens()
        await asyncio.sleep(self.args.window)
        end, after = time.monotonic(), await self.served_tokens()
        stop.set()
        tokens: dict = {}
        for key, task in runs.items():
            results = await task
            tokens[key] = sum(start <= t < end for r in results for t in r.token_times)
            tokens[f"{key}_statuses"] = dict(Counter(str(r.status) for r in results))
        # The server's count (zerohop_output_tokens_total, of requests that ended in the
        # window) is the figure: the client's own arrival times lag when it is short of CPU.
        server = {t: after.get(t, 0) - before.get(t, 0) for t in ("heavy", "light")}
        tokens["server_output_tokens"] = server
        tokens["client_ratio"] = tokens["heavy"] / max(1, tokens["light"])
        return {**tokens, "ratio": server["heavy"] / max(1, server["light"])}

    async def served_tokens(self) -> dict[str, float]:
        """zerohop_output_tokens_total by tenant, from /metrics."""
        text = (await self.client.get("/metrics")).text
        out = {}
        for line in text.splitlines():
            if line.startswith("zerohop_output_tokens_total{"):
                labels, _, value = line.rpartition(" ")
                tenant = labels.split('tenant="', 1)[1].split('"', 1)[0]
                out[tenant] = float(value)
        return out


def p50(values: list[float]) -> float:
    return statistics.median(values) * 1000


def gap_figures(gaps: list[float]) -> dict[str, float | int | None]:
    """The flood's gaps between tokens: p50, p99 and max in ms (the inter-token target is a
    step's time; a client sees a step's tokens as one gap and near-zero ones)."""
    if not gaps:
        return {"gaps": 0, "p50": None, "p99": None, "max": None}
    ordered = sorted(gaps)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"gaps": len(gaps), "p50": p50(gaps), "p99": p99 * 1000, "max": ordered[-1] * 1000}


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


def run(args: argparse.Namespace) -> dict:
    from zerohop.engine.loading.checkpoint import open_checkpoint

    wanted = set(args.only.split(",")) if args.only else set(SCENARIOS)
    prompts = TextPrompts.for_tokenizer(open_checkpoint(default_model()).tokenizer())
    log_dir = args.out.parent
    report: dict = {"max_num_seqs": args.max_num_seqs, "threads": args.threads}
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "keys.db"
        keys = make_keys(db)
        with serve("vtc", args, db, log_dir) as server:
            load = Load(server.url, keys, prompts, args)
            if "idle" in wanted:
                report["idle_ttft_ms"] = p50(load.run(load.probe, "probe"))
                print(f"  idle_ttft_ms: {report['idle_ttft_ms']}")
            if "flood" in wanted:
                report["vtc_flood_ttft_ms"] = p50(load.run(load.under, {"flood": 32}, "probe"))
                print(f"  vtc_flood_ttft_ms: {report['vtc_flood_ttft_ms']}")
                report["vtc_flood_inter_token_ms"] = gap_figures(load.gaps)
                print(f"  vtc_flood_inter_token_ms: {report['vtc_flood_inter_token_ms']}")
            if "batch" in wanted:
                report["batch_ttft_ms"] = p50(load.run(load.under, {"bulk": 32}, "chat"))
                print(f"  batch_ttft_ms: {report['batch_ttft_ms']}")
        if "weights" in wanted:  # shares of the engine alone: no overload refusals
            with serve("vtc", args, db, log_dir, ["--max-queue-wait", "0"]) as server:
                load = Load(server.url, keys, prompts, args)
                report["weights"] = load.run(load.weighted)
                print(f"  weights: {report['weights']}")
        if "fcfs" in wanted:
            with serve("fcfs", args, db, log_dir) as server:
                load = Load(server.url, keys, prompts, args)
                report["fcfs_flood_ttft_ms"] = p50(load.run(load.under, {"flood": 32}, "probe"))
                print(f"  fcfs_flood_ttft_ms: {report['fcfs_flood_ttft_ms']}")
        if "refusals" in wanted:
            extra = ["--max-waiting", "1", "--max-num-seqs", "1"]
            with serve("vtc", args, db, log_dir, extra) as server:
                api_pid = server_pids(server.process.pid)["api"]
                report["refusals"] = asyncio.run(refusal_cost(server.url, keys, api_pid, args))
                print(f"  refusals: {report['refusals']}")
    return report


def print_report(report: dict) -> None:
    idle = report.get("idle_ttft_ms")
    rows = [["TTFT p50, idle", f"{idle:.0f} ms", ""]] if idle else []
    for key, label in (
        ("vtc_flood_ttft_ms", "B's TTFT p50, A flooding, VTC (target <= 2x idle)"),
        ("fcfs_flood_ttft_ms", "B's TTFT p50, A flooding, FCFS"),
        ("batch_ttft_ms", "interactive TTFT p50, batch flooding (target <= 2x idle)"),
    ):
        if key in report:
            ratio = f"{report[key] / idle:.2f}x idle" if idle else ""
            rows.append([label, f"{report[key]:.0f} ms", ratio])
    if gaps := report.get("vtc_flood_inter_token_ms"):
        rows.append(["A's inter-token gap p50 / p99 / max during B's probes (target p99 <="
                     " --inter-token-target, 150 ms)", f"{gaps['p50']:.0f} / {gaps['p99']:.0f}"
                     f" / {gaps['max']:.0f} ms", f"{gaps['gaps']} gaps"])  # fmt: skip
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
    print_table(["measure", "value", ""], rows)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    report = run(args)
    print_report(report)
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
