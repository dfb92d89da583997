"""One-stream decode speed with an unrelated busy process on the machine (a noisy neighbour).

The engine decodes one sequence (c=1) on the default model with its threads (default 2);
a `while True: pass` process runs beside it, unpinned or pinned to one CPU, in rounds that
alternate with quiet ones, so each noisy figure has a quiet one from the same minutes.
Reported per condition: mean and median ms per decode step (TPOT: mean, since a stalled step
counts in full) and the ratio of the mean to the quiet mean.

    .venv/bin/python benchmarks/noisy_neighbour.py [--model-dir M] [--threads 2]
        [--rounds 3] [--steps 64] [--neighbours none,any,cpu0,cpu1]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import ROOT, model_path, print_table, write_json

BUSY = "while True: pass"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", default=None, help="a .gguf, a folder, `standard` or `tiny`")
    p.add_argument("--threads", type=int, default=2, help="the engine's threads")
    p.add_argument("--quantization", default="auto", help="auto, q8_0 or none (float32)")
    p.add_argument("--rounds", type=int, default=3, help="passes over every condition")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per pass")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument(
        "--neighbours",
        default="none,any,cpu0,cpu1",
        help="conditions: none (quiet), any (unpinned busy loop), cpuN (pinned to CPU N)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "noisy_neighbour.json")
    return p.parse_args(argv)


def start_neighbour(condition: str) -> subprocess.Popen | None:
    if condition == "none":
        return None
    command = [sys.executable, "-c", BUSY]
    if condition.startswith("cpu"):
        cpu = int(condition[3:])
        command = [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\n{BUSY}"]
    neighbour = subprocess.Popen(command)
    time.sleep(0.3)  # running, and pinned, before the timed steps
    return neighbour


def stop_neighbour(neighbour: subprocess.Popen | None) -> None:
    if neighbour is not None:
        neighbour.terminate()
        neighbour.wait()


def decode_steps(llm: Any, args: argparse.Namespace, rng: random.Random) -> list[float]:
    """Seconds of each decode step of one sequence (its prefill done first, untimed)."""
    from zerohop import SamplingParams

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    prompt = [rng.randrange(10, vocab) for _ in range(args.prompt_tokens)]
    params = SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True)
    engine.add_request(f"noisy-{rng.random()}", prompt, params)
    engine.step()  # the prefill (one chunk at these lengths) and the first token
    seconds = []
    while engine.has_unfinished() and len(seconds) < args.steps:
        start = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return seconds


def summarize(samples: dict[str, list[float]]) -> list[dict]:
    quiet = statistics.fmean(samples["none"]) if samples.get("none") else None
    rows = []
    for condition, seconds in samples.items():
        mean = statistics.fmean(seconds)
        rows.append(
            {
                "neighbour": condition,
                "steps": len(seconds),
                "mean_ms": 1000 * mean,
                "median_ms": 1000 * statistics.median(seconds),
                "p90_ms": 1000 * sorted(seconds)[int(0.9 * (len(seconds) - 1))],
                "vs_quiet": mean / quiet if quiet else None,
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    from zerohop import LLM

    model = model_path(args.model_dir)
    llm = LLM(str(model), num_threads=args.threads, quantization=args.quantization)
    conditions = args.neighbours.split(",")
    rng = random.Random(0)
    decode_steps(llm, args, rng)  # warm-up
    samples: dict[str, list[float]] = {c: [] for c in conditions}
    for _ in range(args.rounds):
        for condition in conditions:
            neighbour = start_neighbour(condition)
            try:
                samples[condition] += decode_steps(llm, args, rng)
            finally:
                stop_neighbour(neighbour)
    rows = summarize(samples)
    print(f"model {model}, {args.threads} threads, {os.cpu_count()} CPUs; c=1 decode steps")
    print_table(
        ["neighbour", "steps", "mean ms", "median ms", "p90 ms", "mean vs quiet"],
        [[r[k] for k in ("neighbour", "steps", "mean_ms", "median_ms", "p90_ms", "vs_quiet")]
         for r in rows],
    )  # fmt: skip
    report = {"model": str(model), "threads": args.threads, "rows": rows, "samples": samples}
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
