"""Inter-token latency while new prompts arrive beside running streams (issue 22, task 2).

The engine in this process (the default model, --threads 1 engine thread, the serve defaults
otherwise), driven by a clock: requests are added when they arrive, every token is stamped
as its step returns. Each round runs every --targets value side by side on the same warm
engine and the same arrival times (the round's seed; every run's prompts are new to the
prefix cache); 0 is the old scheduler (the whole max_num_batched_tokens in every step, so a
new batch's prefill shares one step with the running decodes), the others cap the prompt
tokens of a step that carries decodes (EngineConfig.inter_token_target, seconds).

Scenarios (prompts cut from an English passage in the model's tokens, greedy, eos ignored):
  staggered  --streams closed-loop streams, each sending --input-tokens -> --output-tokens
             requests one after another with exponential think times (mean --think s), so a
             prompt arrives while other streams decode;
  burst      --streams streams decoding long answers (--burst-output tokens), and every
             --burst-every s a batch of --streams new requests arriving at once: the case
             the issue saw (8 x 64 prompt tokens in one ~2 s step beside 8 decodes).
Reported per scenario and target: inter-token gaps p50/p90/p99/max (every gap between two
tokens of a request), p99/p50, TTFT p50/p99, output and total (prompt + output) tokens per
second of the run's wall time, steps and the longest step; each figure at its median over
the rounds. Target: inter-token p99 <= 3 x its p50, throughput not visibly worse.

    .venv/bin/python benchmarks/arrivals.py [--seconds 30] [--rounds 2] [--out FILE]
    .venv/bin/python benchmarks/arrivals.py --quick     # tiny model, short: a smoke test

Run it alone: other work on the machine stretches steps in one variant and not the other.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import ROOT, TextPrompts, model_path, print_table, write_json

SCENARIOS = ("staggered", "burst")
RUN_IDS = itertools.count()  # each run's prompts are its own: none is in the prefix cache


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", default=None, help="default: the default model; or `tiny`")
    p.add_argument("--threads", type=int, default=1, help="engine threads")
    p.add_argument("--targets", default="0,0.15", help="inter_token_target values, seconds")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--input-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--think", type=float, default=0.5, help="staggered: mean seconds between")
    p.add_argument("--burst-output", type=int, default=100_000, help="burst: long answers")
    p.add_argument("--burst-every", type=float, default=6.0, help="burst: seconds between")
    p.add_argument("--seconds", type=float, default=30.0, help="arrivals per run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny model, short runs")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "arrivals.json")
    args = p.parse_args(argv)
    args.targets = [float(t) for t in args.targets.split(",")]
    args.scenarios = args.scenarios.split(",")
    if args.quick:
        args.model_dir = args.model_dir or "tiny"
        args.seconds, args.rounds = min(args.seconds, 4.0), 1
        args.burst_every = min(args.burst_every, 1.0)
    return args


@dataclass(slots=True)
class Request:
    sent: float
    prompt_tokens: int
    stream: int
    stamps: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Run:
    requests: list[Request]
    wall: float
    steps: list[tuple[int, int, float]]  # (decodes, prompt tokens, seconds) of each step


class Driver:
    """One scenario on the engine: arrivals by the clock, a step whenever there is work."""

    def __init__(self, engine: Any, prompts: TextPrompts, args: argparse.Namespace):
        self.engine, self.prompts, self.args = engine, prompts, args
        self.rng = random.Random(f"prompts-{next(RUN_IDS)}")
        self.live: dict[str, Request] = {}
        self.done: list[Request] = []
        self.steps: list[tuple[int, int, float]] = []
        self.ids = 0

    def send(self, now: float, stream: int, max_tokens: int) -> None:
        from zerohop import SamplingParams

        prompt = self.prompts.prompt(self.rng, self.args.input_tokens)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        request_id = f"r{self.ids}"
        self.ids += 1
        self.engine.add_request(request_id, prompt, params)
        self.live[request_id] = Request(now, len(prompt), stream)

    def step(self, clock: float) -> list[Request]:
        """One engine step: the requests it finished."""
        started = time.perf_counter()
        deltas = self.engine.step()
        now = time.perf_counter()
        decodes = sum(1 for d in deltas if d.new_token_ids and not d.prompt_tokens_processed)
        prompt = sum(d.prompt_tokens_processed for d in deltas)
        self.steps.append((decodes, prompt, now - started))
        finished = []
        for d in deltas:
            request = self.live.get(d.request_id)
            if request is None:
                continue
            request.stamps += [now - clock] * len(d.new_token_ids)
            if d.finished:
                finished.append(self.live.pop(d.request_id))
        self.done += finished
        return finished


def run_staggered(engine: Any, prompts: TextPrompts, args: argparse.Namespace, seed: int) -> Run:
    driver = Driver(engine, prompts, args)
    rng = random.Random(seed + 1)
    next_send = {s: rng.uniform(0, args.think) for s in range(args.streams)}
    return _drive(driver, args, next_send, lambda s, now: now + rng.expovariate(1 / args.think))


def run_burst(engine: Any, prompts: TextPrompts, args: argparse.Namespace, seed: int) -> Run:
    driver = Driver(engine, prompts, args)
    n = args.streams
    # Streams 0..n-1 decode long answers; n..2n-1 arrive together every --burst-every s.
    next_send = {s: 0.0 for s in range(n)} | {n + s: args.burst_every / 2 for s in range(n)}

    def after(stream: int, now: float) -> float | None:
        if stream < n:
            return None  # a long answer runs to the end of the run
        waves = int(now / args.burst_every) + 1
        return waves * args.burst_every + args.burst_every / 2

    return _drive(driver, args, next_send, after, long_streams=n)


def _drive(driver: Driver, args, next_send, after, long_streams: int = 0) -> Run:
    """Send each stream's requests by the clock until --seconds, then stop the long ones and
    let the rest finish."""
    clock = time.perf_counter()
    pending = dict(next_send)
    while True:
        now = time.perf_counter() - clock
        for stream, due in list(pending.items()):
            if due is not None and due <= now and now < args.seconds:
                long = stream < long_streams
                tokens = args.burst_output if long else args.output_tokens
                driver.send(now, stream, tokens)
                pending[stream] = None
        if now >= args.seconds:
            for request_id, r in driver.live.items():
                if r.stream < long_streams:
                    driver.engine.abort(request_id)
        if not driver.engine.has_unfinished():
            upcoming = [d for d in pending.values() if d is not None and d < args.seconds]
            if not upcoming or now >= args.seconds:
                break
            time.sleep(max(0.0, min(upcoming) - now))
            continue
        for r in driver.step(clock):
            if r.stream >= long_streams or long_streams == 0:
                pending[r.stream] = after(r.stream, r.stamps[-1] if r.stamps else now)
    wall = time.perf_counter() - clock
    return Run(driver.done + list(driver.live.values()), wall, driver.steps)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(run: Run) -> dict[str, float]:
    gaps = [b - a for r in run.requests for a, b in zip(r.stamps, r.stamps[1:], strict=False)]
    ttft = [r.stamps[0] - r.sent for r in run.requests if r.stamps]
    output = sum(len(r.stamps) for r in run.requests)
    prompt = sum(r.prompt_tokens for r in run.requests if r.stamps)
    p50 = percentile(gaps, 0.5)
    mixed = [s for d, p, s in run.steps if d and p]
    return {
        "itl_p50_ms": p50 * 1e3,
        "itl_p90_ms": percentile(gaps, 0.9) * 1e3,
        "itl_p99_ms": percentile(gaps, 0.99) * 1e3,
        "itl_max_ms": max(gaps, default=0.0) * 1e3,
        "itl_p99_over_p50": percentile(gaps, 0.99) / p50 if p50 else 0.0,
        "ttft_p50_ms": percentile(ttft, 0.5) * 1e3,
        "ttft_p99_ms": percentile(ttft, 0.99) * 1e3,
        "output_tok_s": output / run.wall,
        "total_tok_s": (output + prompt) / run.wall,
        "requests": len(ttft),
        "steps": len(run.steps),
        "mixed_steps": len(mixed),
        "mixed_step_p50_ms": percentile(mixed, 0.5) * 1e3,
        "longest_mixed_step_ms": max(mixed, default=0.0) * 1e3,
        "longest_step_ms": max((s for *_, s in run.steps), default=0.0) * 1e3,
    }


def load(args: argparse.Namespace) -> Any:
    from zerohop import LLM

    return LLM(str(model_path(args.model_dir)), num_threads=args.threads).engine


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    engine = load(args)
    prompts = TextPrompts.for_tokenizer(engine.tokenizer)
    runners = {"staggered": run_staggered, "burst": run_burst}
    results: dict[str, dict[float, list[dict[str, float]]]] = {
        s: {t: [] for t in args.targets} for s in args.scenarios
    }
    step_log: dict[str, dict[str, Any]] = {s: {} for s in args.scenarios}  # the last round's
    for round_ in range(args.rounds):
        for scenario in args.scenarios:
            targets = args.targets if round_ % 2 == 0 else args.targets[::-1]
            for target in targets:
                engine.scheduler.prefill_budget.target = target
                run = runners[scenario](engine, prompts, args, seed=1000 * round_ + 7)
                figures = summarize(run)
                results[scenario][target].append(figures)
                step_log[scenario][f"{target:g}"] = run.steps
                print(f"round {round_} {scenario} target {target:g}: {_line(figures)}", flush=True)
    report = report_of(args, results)
    report["steps_last_round"] = step_log
    report["step_times"] = engine.stats().step_times
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return 0


def _line(f: dict[str, float]) -> str:
    return (
        f"itl p50 {f['itl_p50_ms']:.1f} ms p99 {f['itl_p99_ms']:.1f} ms"
        f" ({f['itl_p99_over_p50']:.1f}x), ttft p50 {f['ttft_p50_ms']:.0f} ms,"
        f" {f['output_tok_s']:.1f} out tok/s, {f['total_tok_s']:.1f} tok/s"
    )


def report_of(args: argparse.Namespace, results: dict) -> dict[str, Any]:
    keys = ("itl_p50_ms", "itl_p99_ms", "itl_p99_over_p50", "itl_max_ms", "ttft_p50_ms",
            "ttft_p99_ms", "output_tok_s", "total_tok_s", "mixed_steps",
            "longest_mixed_step_ms")  # fmt: skip
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for scenario, by_target in results.items():
        rows = []
        summary[scenario] = {}
        for target, runs in by_target.items():
            medians = {k: statistics.median(r[k] for r in runs) for k in keys}
            summary[scenario][f"{target:g}"] = medians
            rows.append([f"{scenario} {target:g}", *(medians[k] for k in keys)])
        print()
        print_table(["scenario target", *keys], rows)
        base = summary[scenario][f"{args.targets[0]:g}"]
        for target in args.targets[1:]:
            cur = summary[scenario][f"{target:g}"]
            print(
                f"{scenario}: target {target:g} / {args.targets[0]:g}: itl p99"
                f" {_ratio(cur, base, 'itl_p99_ms')}, output tok/s"
                f" {_ratio(cur, base, 'output_tok_s')}, total tok/s"
                f" {_ratio(cur, base, 'total_tok_s')}, ttft p50 {_ratio(cur, base, 'ttft_p50_ms')}"
            )
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "summary": summary,
        "runs": {s: {f"{t:g}": runs for t, runs in bt.items()} for s, bt in results.items()},
    }


def _ratio(cur: dict[str, float], base: dict[str, float], key: str) -> str:
    return f"{cur[key] / base[key]:.2f}x" if base[key] else "-"


if __name__ == "__main__":
    raise SystemExit(main())
