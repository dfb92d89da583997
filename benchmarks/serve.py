"""Served vs offline, side by side in one run; with --baseline, served against a git ref.

The model is zerohop's default (SmolLM2-135M-Instruct, GGUF) unless --model-dir names another:
a .gguf file, a Hugging Face folder, `standard` (engine_throughput.py's) or `tiny`. Prompts,
offline and served alike, are cut from an English passage in the model's own tokens
(`_common.TextPrompts`, handed to the `zerohop bench` load client as its prompt source).

For each engine thread count in --threads (default 1,2), each of --repeats rounds (default 2):
  offline  `LLM.generate` of N requests x 128 prompt tokens x 64 output tokens (greedy, eos
           ignored): output tokens/s; the prefill time of one 128-token request
           (`max_tokens=1`, median of --prefill-reps, each prompt new to the prefix cache);
  served   `zerohop serve MODEL --num-threads T` with the same engine options, driven by
           `zerohop bench` (OpenAI /v1/completions, streaming):
             throughput      concurrency N, the offline prompts' shape: output tok/s, and
                             the CPU of the API process, the engine process and the client
                             over the run, per request;
             ttft            concurrency 1, 128 in / 8 out, logprobs=0 (a chunk per token);
             ttft_one_token  concurrency 1, 128 in / 1 out: the offline prefill's request.
Each figure counts at its best round (a shared machine only ever slows runs down).
Targets: served / offline throughput >= 0.90; TTFT at c=1 - offline prefill <= 5 ms.

--baseline REF (A/B): the served runs only, from this checkout and from REF checked out into a
temporary worktree, --rounds (default 4) rounds alternating which tree goes first, every run
on a fresh server. Reported per tree: the median, lowest and highest of the rounds' output
tok/s, API-process CPU ms per request and TTFT at c=1, and current / baseline of the medians
against the rounds' spread ((max - min) / median).

    .venv/bin/python benchmarks/serve.py [--threads 1,2] [--repeats 2]
    .venv/bin/python benchmarks/serve.py --baseline HEAD~1 --rounds 4    # A/B
Writes --out (bench-results/serve.json) and a markdown table beside it (serve.md).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import ROOT, TextPrompts, cpu_count, int_list, model_path, open_model
from _procstat import process_cpu_s
from engine_throughput import engine_generate, load_engine
from harness import ab
from harness.report import write_report
from harness.zerohop_server import ENGINE_FLAGS, SERVED_MODEL_NAME, ZerohopServer

from zerohop.bench.load import run_benchmark
from zerohop.bench.load_types import BenchConfig
from zerohop.bench.prompts import make_prompts

THROUGHPUT_TARGET = 0.90
TTFT_GAP_TARGET_MS = 5.0
PromptMaker = Callable[[BenchConfig, int, str], list[list[int]]]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model-dir", default=None,
        help="a .gguf file, a Hugging Face folder, `standard` or `tiny` (default: SmolLM2)",
    )  # fmt: skip
    p.add_argument("--threads", default="1,2", help="engine threads to try, comma-separated")
    p.add_argument("--num-requests", type=int, default=32, help="requests = concurrency")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--ttft-requests", type=int, default=10, help="requests at concurrency 1")
    p.add_argument("--ttft-output-tokens", type=int, default=8)
    p.add_argument("--prefill-reps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2, help="rounds over the thread counts")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--baseline", metavar="REF", help="A/B the served runs against this commit")
    p.add_argument("--rounds", type=int, default=4, help="A/B rounds, alternating (--baseline)")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "serve.json")
    args = p.parse_args(argv)
    args.threads = int_list(p, "--threads", args.threads)
    return args


def prompt_maker(model: Path) -> PromptMaker:
    """A `BenchConfig.prompt_source` of text through the model's own tokenizer."""
    _, tokenizer = open_model(model)
    text = TextPrompts.for_tokenizer(tokenizer)

    def make(cfg: BenchConfig, n: int, salt: str = "") -> list[list[int]]:
        rng = random.Random(f"{cfg.seed}-{salt}")
        shared = min(cfg.shared_prefix_tokens, cfg.input_tokens)
        prefix = text.prompt(rng, shared) if shared else []
        return [prefix + text.prompt(rng, cfg.input_tokens - shared) for _ in range(n)]

    return make


def load_config(
    args: argparse.Namespace, url: str, *, concurrency: int, requests: int, output_tokens: int,
    seed: int, **fields: Any,
) -> BenchConfig:  # fmt: skip
    """A load-client run of `args.input_tokens`-token text prompts against the served model."""
    return BenchConfig(
        url=url, concurrency=concurrency, input_tokens=args.input_tokens,
        output_tokens=output_tokens, num_requests=requests, model=SERVED_MODEL_NAME,
        seed=seed, prompt_source=args.prompt_source, **fields,
    )  # fmt: skip


def throughput_config(args: argparse.Namespace, url: str, seed: int = 0) -> BenchConfig:
    n = args.num_requests
    return load_config(
        args, url, concurrency=n, requests=n, output_tokens=args.output_tokens, seed=seed
    )


def ttft_config(
    args: argparse.Namespace, url: str, output_tokens: int, logprobs: int | None
) -> BenchConfig:
    return load_config(
        args, url, concurrency=1, requests=args.ttft_requests, output_tokens=output_tokens,
        seed=100 + output_tokens,  # not the throughput run's prompts, now in the prefix cache
        logprobs=logprobs,
    )  # fmt: skip


# -- offline ------------------------------------------------------------------------------------


def run_offline(args: argparse.Namespace, model: Path, threads: int) -> dict[str, Any]:
    engine_args = argparse.Namespace(
        max_num_batched_tokens=args.max_num_batched_tokens, threads=threads
    )
    llm = load_engine(model, engine_args)
    cfg = throughput_config(args, "")
    engine_generate(llm, make_prompts(cfg, 2, "offline-warmup"), [8, 8])
    prompts = make_prompts(cfg, args.num_requests, "bench")
    seconds, outs = engine_generate(llm, prompts, [args.output_tokens] * len(prompts))
    produced = sum(len(o.token_ids) for o in outs)
    prefill = [
        engine_generate(llm, make_prompts(cfg, 1, f"prefill-{rep}"), [1])[0]
        for rep in range(args.prefill_reps)
    ]
    del llm, outs
    gc.collect()
    return {
        "output_throughput": produced / seconds,
        "prefill_median_ms": 1000 * statistics.median(prefill),
    }


# -- served -------------------------------------------------------------------------------------


def run_served(
    args: argparse.Namespace, model: Path, threads: int, tree: ab.Tree = ab.CURRENT
) -> dict[str, Any]:
    flags = [*ENGINE_FLAGS, "--num-threads", str(threads)]
    flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    log = args.out.parent / f"serve-server-{tree.name}-t{threads}.log"
    with ZerohopServer(model, flags, log, tree=tree) as server:
        cfg = throughput_config(args, server.url)
        cpu = CpuMeter(server)
        throughput = run_benchmark(cfg)["summary"]
        used = cpu.stop(throughput["completed"] + cfg.warmup_requests)
        ttft = run_benchmark(ttft_config(args, server.url, args.ttft_output_tokens, 0))
        one = run_benchmark(ttft_config(args, server.url, 1, None))
    s_ttft, s_one = ttft["summary"], one["summary"]
    # TTFT of the 8-token run is the first token's only if every token had its own chunk.
    source = s_ttft if s_ttft["checks"]["one_event_per_token"] else s_one
    failed = throughput["failed"] + s_ttft["failed"] + s_one["failed"]
    return {
        "output_throughput": throughput["output_throughput"],
        "ttft_c1_p50_ms": (source["ttft_ms"] or {}).get("p50"),
        "ttft_one_token_p50_ms": (s_one["ttft_ms"] or {}).get("p50"),
        "tpot_p50_ms": (throughput["tpot_ms"] or {}).get("p50"),
        "cpu": used,
        "failed": failed,
        "server_log": str(log),
    }


class CpuMeter:
    """CPU seconds of the API process, the engine process and this load client over a run."""

    def __init__(self, server: ZerohopServer) -> None:
        self.pids = {"api": server.api_pid()}
        if engine := server.engine_pid():
            self.pids["engine"] = engine
        self.start = self._now()

    def _now(self) -> dict[str, float]:
        now = {"wall": time.perf_counter(), "client": time.process_time()}
        return now | {name: process_cpu_s(pid) for name, pid in self.pids.items()}

    def stop(self, requests: int) -> dict[str, float]:
        end = self._now()
        used = {f"{k}_s": end[k] - self.start[k] for k in end}
        return used | {
            f"{k}_ms_per_request": 1000 * used[f"{k}_s"] / max(1, requests)
            for k in end
            if k != "wall"
        }


# -- served vs offline --------------------------------------------------------------------------


def measure(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    rounds: dict[int, list[dict[str, Any]]] = {t: [] for t in args.threads}
    for rep in range(args.repeats):
        for t in args.threads:
            print(f"\n== engine threads {t}, round {rep + 1}: offline, then served", flush=True)
            offline = run_offline(args, model, t)
            served = run_served(args, model, t)
            print(f"  offline {offline['output_throughput']:.1f} tok/s, served "
                  f"{served['output_throughput']:.1f} tok/s", flush=True)  # fmt: skip
            rounds[t].append({"offline": offline, "served": served})
    return {str(t): best(runs) | {"rounds": runs} for t, runs in rounds.items()}


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure at its best over the rounds: highest throughputs, lowest prefill and TTFT."""
    offline = max(r["offline"]["output_throughput"] for r in runs)
    served = max(r["served"]["output_throughput"] for r in runs)
    prefill = min(r["offline"]["prefill_median_ms"] for r in runs)
    ttfts = [r["served"]["ttft_c1_p50_ms"] for r in runs if r["served"]["ttft_c1_p50_ms"]]
    ttft = min(ttfts) if ttfts else None
    api_cpu = min(r["served"]["cpu"]["api_ms_per_request"] for r in runs)
    return {
        "offline_output_throughput": offline,
        "served_output_throughput": served,
        "served_over_offline": served / offline,
        "offline_prefill_ms": prefill,
        "served_ttft_c1_p50_ms": ttft,
        "ttft_minus_prefill_ms": None if ttft is None else ttft - prefill,
        "api_cpu_ms_per_request": api_cpu,
        "failed": sum(r["served"]["failed"] for r in runs),
    }


def offline_rows(results: dict[str, Any]) -> list[list[object]]:
    keys = ("offline_output_throughput", "served_output_throughput", "served_over_offline",
            "offline_prefill_ms", "served_ttft_c1_p50_ms", "ttft_minus_prefill_ms",
            "api_cpu_ms_per_request", "failed")  # fmt: skip
    return [[t, *(r[k] for k in keys)] for t, r in results.items()]


OFFLINE_HEADERS = ["engine threads", "offline tok/s", "served tok/s", "served/offline",
                   "prefill ms", "TTFT c=1 p50 ms", "TTFT - prefill ms", "API CPU ms/req",
                   "failed"]  # fmt: skip


# -- A/B against a ref --------------------------------------------------------------------------

AB_FIGURES = {  # figure -> how to read it from a served run
    "output tok/s": lambda s: s["output_throughput"],
    "API CPU ms/request": lambda s: s["cpu"]["api_ms_per_request"],
    "engine CPU ms/request": lambda s: s["cpu"].get("engine_ms_per_request"),
    "TTFT c=1 p50 ms": lambda s: s["ttft_c1_p50_ms"],
}


def measure_ab(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    with ab.trees(args.baseline) as sides:
        for r, tree in ab.alternating(args.rounds, sides):
            for t in args.threads:
                print(f"\n== round {r + 1}: {tree.name}, engine threads {t}", flush=True)
                served = run_served(args, model, t, tree)
                api_ms = served["cpu"]["api_ms_per_request"]
                tok_s = served["output_throughput"]
                print(f"  {tok_s:.1f} tok/s, API CPU {api_ms:.2f} ms/request", flush=True)
                runs.setdefault(tree.name, {}).setdefault(t, []).append(served)
        names = [tree.name for tree in sides]
    return {"trees": names, "runs": runs, "compare": ab_compare(runs, names, args.threads)}


def ab_compare(
    runs: dict[str, dict[int, list[dict[str, Any]]]], names: list[str], threads: list[int]
) -> dict[str, Any]:
    current, baseline = names
    out: dict[str, Any] = {}
    for t in threads:
        for figure, read in AB_FIGURES.items():
            a = [v for s in runs[current][t] if (v := read(s)) is not None]
            b = [v for s in runs[baseline][t] if (v := read(s)) is not None]
            out[f"t{t} {figure}"] = ab.compare(a, b)
    return out


def ab_rows(compared: dict[str, Any]) -> list[list[object]]:
    rows: list[list[object]] = []
    for name, c in compared.items():
        cur, base = c["current"], c["baseline"]
        rows.append([
            name, cur["median"], f"{cell_range(cur)}", base["median"], f"{cell_range(base)}",
            c["ratio"], max_spread(c), c["beyond_spread"],
        ])  # fmt: skip
    return rows


def cell_range(s: dict[str, Any]) -> str:
    return "-" if s["min"] is None else f"{s['min']:.3g}-{s['max']:.3g}"


def max_spread(c: dict[str, Any]) -> float | None:
    spreads = [s for s in (c["current"]["spread"], c["baseline"]["spread"]) if s is not None]
    return max(spreads) if spreads else None


AB_HEADERS = ["figure", "current median", "current range", "baseline median", "baseline range",
              "current/baseline", "spread", "beyond spread"]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model = model_path(args.model_dir)
    args.prompt_source = prompt_maker(model)
    report: dict[str, Any] = {
        "model": str(model), "cpus": cpu_count(), "threads": args.threads,
        "workload": {k: getattr(args, k) for k in (
            "num_requests", "input_tokens", "output_tokens", "ttft_requests",
            "ttft_output_tokens", "repeats", "rounds", "baseline")},
        "targets": {"served_over_offline": THROUGHPUT_TARGET, "ttft_gap_ms": TTFT_GAP_TARGET_MS},
    }  # fmt: skip
    if args.baseline:
        report["ab"] = measure_ab(args, model)
        print("\n== A/B: medians over the rounds, current / baseline")
        write_report(args.out, report, AB_HEADERS, ab_rows(report["ab"]["compare"]))
    else:
        report["results"] = measure(args, model)
        print("\n== served vs offline (best round)")
        write_report(args.out, report, OFFLINE_HEADERS, offline_rows(report["results"]))
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
