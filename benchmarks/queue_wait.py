"""Overload refusals against the queue wait they predict (issue 19, failure 5).

`zerohop serve` (the default model, float32 weights: --quantization none, --num-threads 2,
--max-queue-wait 30) as a subprocess, driven by an aiohttp client over streamed OpenAI
/v1/completions (128 prompt tokens of text -> 64 output tokens, eos ignored):

  burst     12 requests one at a time, a quiet period (--quiet-seconds, default 60), then 64
            requests at concurrency 32: what the issue saw refused (44 of 64) by an estimate
            that extrapolated the light load's rate to the full batch. Target: 0 refused.
  overload  open-loop Poisson arrivals at --overload-factor (4) x the capacity the burst
            measured (its served requests per second), for --overload-seconds. Target: some
            refused, and every admitted request's actual wait below --max-queue-wait.

Each admitted response carries `zerohop-predicted-queue-wait-ms` (what admission predicted for
it) and `zerohop-actual-queue-wait-ms` (the wait the server measured: from handing it to the
engine to the start of the engine step that computed its first prompt chunk, i.e. its first
delta's arrival less that step's time; the same end points as the prediction, so the ratio is
the model's error, without its own prefill). Reported per scenario: refusals, actual/predicted
p50 and p90 (over requests predicted to wait at least --ratio-floor-ms; the others are counted
and their absolute error given), the largest actual wait, and TTFT p50/p90/p99 as the client
saw it.

    .venv/bin/python benchmarks/queue_wait.py [--quiet-seconds 60] [--out FILE]
    .venv/bin/python benchmarks/queue_wait.py --quick    # tiny model, short: a smoke test

Run it alone: other work on the machine slows the engine's steps after the model measured them.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from _common import ROOT, TextPrompts, model_path, open_model, print_table, write_json
from harness.zerohop_server import SERVED_MODEL_NAME, ZerohopServer

PREDICTED = "zerohop-predicted-queue-wait-ms"
ACTUAL = "zerohop-actual-queue-wait-ms"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", default=None, help="default: the default model; or `tiny`")
    p.add_argument("--threads", type=int, default=2, help="engine threads")
    p.add_argument("--quantization", default="none", help="none: float32 weights")
    p.add_argument("--max-queue-wait", type=float, default=30.0, help="seconds")
    p.add_argument("--quiet-seconds", type=float, default=60.0, help="between light load and burst")
    p.add_argument("--light-requests", type=int, default=12)
    p.add_argument("--burst-requests", type=int, default=64)
    p.add_argument("--burst-concurrency", type=int, default=32)
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--overload-factor", type=float, default=4.0)
    p.add_argument("--overload-seconds", type=float, default=60.0)
    p.add_argument("--ratio-floor-ms", type=float, default=100.0)
    p.add_argument("--quick", action="store_true", help="tiny model, short periods")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "queue_wait.json")
    args = p.parse_args(argv)
    if args.quick:
        args.model_dir = args.model_dir or "tiny"
        args.quiet_seconds = min(args.quiet_seconds, 2.0)
        args.overload_seconds = min(args.overload_seconds, 10.0)
        args.max_queue_wait = min(args.max_queue_wait, 3.0)
        args.ratio_floor_ms = min(args.ratio_floor_ms, 20.0)
    return args


# -- the server ---------------------------------------------------------------------------------


def start_server(args: argparse.Namespace, model: Path, workdir: Path) -> ZerohopServer:
    """`zerohop serve MODEL` with a data folder of its own."""
    flags = [
        "--num-threads", str(args.threads), "--quantization", args.quantization,
        "--max-queue-wait", str(args.max_queue_wait),
        # The overload's client opens a connection per request in flight, all from here.
        "--max-connections-per-address", "8192", "--max-connections", "8192",
    ]  # fmt: skip
    log = workdir / "server.log"
    return ZerohopServer(model, flags, log, XDG_DATA_HOME=str(workdir / "data"))


# -- one request --------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    status: int = 0
    sent_at: float = 0.0  # seconds after the scenario started
    predicted_ms: float | None = None
    actual_ms: float | None = None
    ttft: float | None = None  # seconds, to the first token's event
    error: str | None = None


async def send(
    session: aiohttp.ClientSession, url: str, prompt: list[int], args: argparse.Namespace
) -> Outcome:
    body = {
        "model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": args.output_tokens,
        "ignore_eos": True, "temperature": 0, "stream": True,
    }  # fmt: skip
    out, start = Outcome(), time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            out.status = response.status
            out.predicted_ms = _number(response.headers.get(PREDICTED))
            out.actual_ms = _number(response.headers.get(ACTUAL))
            if response.status != 200:
                out.error = (await response.text())[:300]
                return out
            async for line in response.content:
                if out.ttft is None and line.startswith(b"data: {"):
                    out.ttft = time.perf_counter() - start
    except (TimeoutError, aiohttp.ClientError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


def _number(value: str | None) -> float | None:
    return None if value is None else float(value)


# -- the scenarios ------------------------------------------------------------------------------


@dataclass(slots=True)
class Scenario:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0


async def light_then_burst(url: str, args: argparse.Namespace, prompts: Prompts) -> Scenario:
    async with _session(args.burst_concurrency) as session:
        for _ in range(args.light_requests):
            await send(session, url, prompts.next(), args)
        await asyncio.sleep(args.quiet_seconds)
        gate = asyncio.Semaphore(args.burst_concurrency)
        started = time.perf_counter()

        async def one() -> Outcome:
            async with gate:
                sent_at = time.perf_counter() - started
                out = await send(session, url, prompts.next(), args)
                out.sent_at = sent_at
                return out

        outcomes = await asyncio.gather(*(one() for _ in range(args.burst_requests)))
    return Scenario("burst", list(outcomes), time.perf_counter() - started)


async def overload(url: str, args: argparse.Namespace, prompts: Prompts, rate: float) -> Scenario:
    rng = random.Random(1)
    tasks: list[asyncio.Task] = []
    async with _session(10_000) as session:
        started = time.perf_counter()
        t = 0.0
        while t < args.overload_seconds:
            await asyncio.sleep(max(0.0, started + t - time.perf_counter()))
            tasks.append(asyncio.create_task(_at(session, url, prompts.next(), args, t)))
            t += rng.expovariate(rate)
        outcomes = await asyncio.gather(*tasks)
    return Scenario("overload", list(outcomes), time.perf_counter() - started)


async def _at(
    session: aiohttp.ClientSession, url: str, prompt: list[int], args: argparse.Namespace, t: float
) -> Outcome:
    out = await send(session, url, prompt, args)
    out.sent_at = t
    return out


def _session(connections: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=connections + 8)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900))


class Prompts:
    """Text prompts of exact lengths in the model's tokens, each new to the prefix cache."""

    def __init__(self, model: Path, length: int) -> None:
        _, tokenizer = open_model(model)
        self.text = TextPrompts.for_tokenizer(tokenizer)
        self.rng = random.Random(0)
        self.length = length

    def next(self) -> list[int]:
        return self.text.prompt(self.rng, self.length)


# -- figures ------------------------------------------------------------------------------------


def summarize(s: Scenario, args: argparse.Namespace) -> dict:
    served = [o for o in s.outcomes if o.status == 200 and o.error is None]
    refused = [o for o in s.outcomes if o.status in (503, 529)]
    timed = [o for o in served if o.predicted_ms is not None and o.actual_ms is not None]
    ratios = [o.actual_ms / o.predicted_ms for o in timed if o.predicted_ms >= args.ratio_floor_ms]
    small = [o for o in timed if o.predicted_ms < args.ratio_floor_ms]
    errors = [abs(o.actual_ms - o.predicted_ms) for o in small]
    actual = [o.actual_ms for o in timed]
    ttft = [o.ttft for o in served if o.ttft is not None]
    limit_ms = args.max_queue_wait * 1000
    return {
        "requests": len(s.outcomes),
        "served": len(served),
        "refused": len(refused),
        "failed": len(s.outcomes) - len(served) - len(refused),
        "seconds": s.seconds,
        "served_per_second": len(served) / s.seconds if s.seconds else 0.0,
        "ratio_count": len(ratios),
        "ratio_p50": _pct(ratios, 50),
        "ratio_p90": _pct(ratios, 90),
        "below_floor": len(small),
        "below_floor_abs_error_ms_p90": _pct(errors, 90),
        "predicted_ms_max": max((o.predicted_ms for o in timed), default=None),
        "actual_ms_p50": _pct(actual, 50),
        "actual_ms_max": max(actual, default=None),
        "admitted_over_max_queue_wait": sum(a > limit_ms for a in actual),
        "ttft_s_p50": _pct(ttft, 50),
        "ttft_s_p90": _pct(ttft, 90),
        "ttft_s_p99": _pct(ttft, 99),
    }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def targets(burst: dict, over: dict) -> dict:
    return {
        "burst_no_refusals": burst["refused"] == 0 and burst["failed"] == 0,
        "overload_refuses": over["refused"] > 0,
        "overload_admitted_within_max_queue_wait": over["admitted_over_max_queue_wait"] == 0,
    }


def print_report(report: dict) -> None:
    keys = [
        "requests", "served", "refused", "failed", "ratio_p50", "ratio_p90", "ratio_count",
        "below_floor", "predicted_ms_max", "actual_ms_max", "admitted_over_max_queue_wait",
        "ttft_s_p50", "ttft_s_p90", "ttft_s_p99",
    ]  # fmt: skip
    rows = [[k, *(report[name][k] for name in ("burst", "overload"))] for k in keys]
    print_table(["", "burst", "overload"], rows)
    print(f"overload rate: {report['overload_rate']:.2f} requests/s "
          f"({report['config']['overload_factor']} x {report['capacity']:.2f})")  # fmt: skip
    for name, ok in report["targets"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")


async def run(args: argparse.Namespace, url: str, prompts: Prompts) -> dict:
    burst = await light_then_burst(url, args, prompts)
    burst_figures = summarize(burst, args)
    capacity = max(burst_figures["served_per_second"], 0.1)
    rate = capacity * args.overload_factor
    over = await overload(url, args, prompts, rate)
    over_figures = summarize(over, args)
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "capacity": capacity,
        "overload_rate": rate,
        "burst": burst_figures,
        "overload": over_figures,
        "targets": targets(burst_figures, over_figures),
        "outcomes": {s.name: [asdict(o) for o in s.outcomes] for s in (burst, over)},
    }


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    model = model_path(args.model_dir)
    prompts = Prompts(model, args.input_tokens)
    with (
        tempfile.TemporaryDirectory(prefix="zerohop-queue-wait-") as tmp,
        start_server(args, model, Path(tmp)) as server,
    ):
        report = asyncio.run(run(args, server.url, prompts))
    print_report(report)
    write_json(args.out, report)
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
