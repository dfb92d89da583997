"""Offline throughput of the zerohop engine against Hugging Face transformers, side by side.

Workloads (token-id prompts, greedy, eos ignored, exact output lengths):
  uniform  N requests, 128 prompt tokens and 32 output tokens each
  mixed    N requests, prompt lengths uniform in 16..256, output lengths uniform in 8..128
  prefix   time to first token of a 1,024-token prefix + 16-token suffix, cold vs warm
           (prefix cached by an earlier request), engine only

transformers runs each workload as people use it: one left-padded static batch, padded to the
longest prompt, `max_new_tokens` = the largest request; only the tokens each request asked for
count, for both engines. The engine runs alone first, so the peak RSS then is the engine side's;
with --repeats > 1 (default 2) later runs alternate the engines and the fastest run counts.

    .venv/bin/python benchmarks/engine_throughput.py [--num-requests 32] [--skip-hf]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _common import (
    STANDARD,
    ModelShape,
    cpu_count,
    ensure_model,
    measure_matmul,
    peak_rss_mib,
    print_table,
    set_threads,
    write_json,
)

SEED = 1234
THROUGHPUT_WORKLOADS = ("uniform", "mixed")
PREFIX_TOKENS = 1024
SUFFIX_TOKENS = 16
FIRST_ID = 4  # skip the toy tokenizer's special tokens in random prompts
PAD_ID = 1


@dataclass(slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


@dataclass(slots=True)
class Run:
    seconds: float
    output_tokens: int
    flops: float
    cached_tokens: int = 0
    notes: list[str] = field(default_factory=list)
    cpu_seconds: float = 0.0  # this process's CPU time: far above 2x seconds = spinning threads
    load_average: float = 0.0  # 1-minute load average at the end: above ~threads = contended
    all_seconds: list[float] = field(default_factory=list)  # every repeat; `seconds` is the best

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    def as_dict(self, dense_flops: float) -> dict:
        return {
            **asdict(self),
            "output_tok_s": self.output_tok_s,
            "flops_per_s": self.flops / self.seconds,
            "flop_fraction": self.flops / self.seconds / dense_flops,
        }


def best_of(runs: list[Run], threads: int) -> Run:
    """The fastest repeat: on a shared machine the minimum is the least disturbed figure."""
    best = min(runs, key=lambda r: r.seconds)
    best.all_seconds = [r.seconds for r in runs]
    best.notes = sorted({n for r in runs for n in r.notes})
    cores = best.cpu_seconds / best.seconds
    if threads > 1 and cores < 0.75 * threads:
        # A quiet run keeps every thread busy; with the cores shared, torch's thread pool
        # waits on descheduled threads and a run can take several times longer.
        best.notes.append(f"even the best run used only {cores:.1f} cores: contended, rerun")
    return best


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def make_workload(name: str, n: int, vocab: int, rep: int = 0) -> Workload:
    """Lengths depend on the workload only; token ids also on the repeat."""
    rng = random.Random(f"{SEED}-{name}")
    if name == "uniform":
        lengths, outputs = [128] * n, [32] * n
    elif name == "mixed":
        lengths = [rng.randint(16, 256) for _ in range(n)]
        outputs = [rng.randint(8, 128) for _ in range(n)]
    else:
        raise ValueError(f"unknown workload {name!r}")
    ids = random.Random(f"{SEED}-{name}-{rep}")
    return Workload(name, [random_ids(ids, length, vocab) for length in lengths], outputs)


def request_flops(shape: ModelShape, prompt: int, output: int, cached: int = 0) -> float:
    """Approximate FLOPs an ideal engine spends on one request.

    Every position fed through the layers costs 2 * layer params (matmuls) plus attention
    4 * hidden * context per layer (QK^T and AV). Fed positions are the uncached prompt and
    all outputs but the last. The lm_head runs only where a token is sampled (`output` rows).
    Norms, rotary, softmax and sampling are left out.
    """
    start, end = cached, prompt + output - 1
    fed = end - start
    contexts = (end * (end + 1) - start * (start + 1)) // 2  # sum of p + 1 for p in [start, end)
    linear = 2 * shape.layers * shape.layer_params() * fed + 2 * shape.lm_head_params() * output
    attention = 4 * shape.hidden * shape.layers * contexts
    return float(linear + attention)


def workload_flops(shape: ModelShape, w: Workload, cached: Sequence[int] | None = None) -> float:
    cached = cached or [0] * len(w.prompts)
    return sum(
        request_flops(shape, len(p), m, c)
        for p, m, c in zip(w.prompts, w.max_tokens, cached, strict=True)
    )


# -- the zerohop engine ------------------------------------------------------------------------


def load_engine(model_dir: Path, args: argparse.Namespace):
    from zerohop import LLM

    return LLM(
        str(model_dir),
        max_num_seqs=64,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=2.0,
        num_threads=args.threads,
    )


def greedy(max_tokens: int):
    from zerohop import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def engine_generate(llm, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list]:
    params = [greedy(m) for m in max_tokens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, outs


def run_engine(llm, w: Workload, shape: ModelShape) -> Run:
    seconds, outs = engine_generate(llm, w.prompts, w.max_tokens)
    notes = []
    for i, (o, p, m) in enumerate(zip(outs, w.prompts, w.max_tokens, strict=True)):
        if list(o.prompt_token_ids) != p:
            notes.append(f"output {i} is not for prompt {i}")
        if len(o.token_ids) != m or o.finish_reason != "length":
            notes.append(f"request {i}: {len(o.token_ids)}/{m} tokens, {o.finish_reason} {o.error}")
    cached = [o.cached_tokens or 0 for o in outs]
    return Run(seconds, w.output_tokens, workload_flops(shape, w, cached), sum(cached), notes)


@dataclass(slots=True)
class PrefixResult:
    cold_ttft_s: list[float] = field(default_factory=list)
    warm_ttft_s: list[float] = field(default_factory=list)
    cold_cached_tokens: list[int] = field(default_factory=list)
    warm_cached_tokens: list[int] = field(default_factory=list)

    @property
    def cold(self) -> float:
        return statistics.median(self.cold_ttft_s)

    @property
    def warm(self) -> float:
        return statistics.median(self.warm_ttft_s)

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "prefix_tokens": PREFIX_TOKENS,
            "suffix_tokens": SUFFIX_TOKENS,
            "cold_median_s": self.cold,
            "warm_median_s": self.warm,
            "cold_over_warm": self.cold / self.warm,
            "hit_confirmed": all(c >= PREFIX_TOKENS for c in self.warm_cached_tokens),
        }


def run_prefix(llm, reps: int, vocab: int) -> PrefixResult:
    """Each rep: a fresh prefix, cold with one suffix, then warm with another (max_tokens=1)."""
    rng = random.Random(f"{SEED}-prefix")
    result = PrefixResult()
    for _ in range(reps):
        prefix = random_ids(rng, PREFIX_TOKENS, vocab)
        for times, cached in (
            (result.cold_ttft_s, result.cold_cached_tokens),
            (result.warm_ttft_s, result.warm_cached_tokens),
        ):
            seconds, outs = engine_generate(
                llm, [prefix + random_ids(rng, SUFFIX_TOKENS, vocab)], [1]
            )
            times.append(seconds)
            cached.append(outs[0].cached_tokens or 0)
    return result


# -- Hugging Face transformers -----------------------------------------------------------------


def load_hf(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run every row to max_new_tokens
    model.generation_config.pad_token_id = PAD_ID
    return model


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, int]:
    """One left-padded static batch; returns (seconds, generated columns)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return time.perf_counter() - start, out.shape[1] - width


def run_hf(model, w: Workload, shape: ModelShape) -> Run:
    seconds, generated = hf_generate(model, w.prompts, max(w.max_tokens))
    notes = [] if generated == max(w.max_tokens) else [f"generated {generated} columns only"]
    return Run(seconds, w.output_tokens, workload_flops(shape, w), 0, notes)


# -- the program -------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--workloads", default="uniform,mixed,prefix")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-results/engine_throughput.json"))
    parser.add_argument("--skip-hf", action="store_true", help="engine only")
    parser.add_argument("--skip-engine", action="store_true", help="transformers only")
    parser.add_argument("--threads", type=int, default=cpu_count(), help="torch threads, both")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs per workload and engine (best counts)"
    )
    parser.add_argument("--prefix-reps", type=int, default=3, help="cold/warm pairs (median)")
    args = parser.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(args.workloads) - {*THROUGHPUT_WORKLOADS, "prefix"}
    if unknown:
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    if min(args.num_requests, args.repeats, args.prefix_reps, args.threads) < 1:
        parser.error("--num-requests, --repeats, --prefix-reps and --threads must be >= 1")
    return args


def dense_flops_per_s() -> tuple[float, list[dict]]:
    results = measure_matmul()
    return max(r.flops_per_s for r in results), [asdict(r) for r in results]


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    shape = STANDARD
    model_dir = ensure_model(args.model_dir)
    set_threads(args.threads)
    dense_before, matmul_before = dense_flops_per_s()
    print(
        f"model {model_dir}, {args.threads} threads, dense fp32 matmul "
        f"{dense_before / 1e9:.1f} GFLOP/s",
        flush=True,
    )
    load_before = os.getloadavg()
    if load_before[0] > 0.5:
        print(
            f"warning: load average {load_before[0]:.1f} before starting: other processes "
            "compete for the cores and the figures will be noisy",
            flush=True,
        )
    bench = Bench(args, model_dir, shape)
    bench.run()
    dense_after, matmul_after = dense_flops_per_s()
    dense = max(dense_before, dense_after)
    report = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "threads": args.threads,
            "cpus": cpu_count(),
            "dense_flops_per_s": dense,
            "matmul": matmul_before + matmul_after,
            # Unset, libgomp spins on shared cores; PASSIVE can be much faster when contended.
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "model": {
            "dir": str(model_dir),
            **asdict(shape),
            "non_embedding_params": shape.non_embedding_params(),
        },
        "engine_options": {
            "max_num_seqs": 64,
            "kv_cache_memory_gib": 2.0,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
        "repeats": args.repeats,
        "flops_note": "approximate: 2*params per fed token (lm_head only at sampled positions) "
        "+ 4*hidden*context per layer for attention; norms/softmax left out",
        "workloads": {},
        "peak_rss_mib": bench.rss,
    }
    for w in bench.workloads[0]:
        e = best_of(bench.engine_runs[w.name], args.threads) if bench.engine_runs[w.name] else None
        h = best_of(bench.hf_runs[w.name], args.threads) if bench.hf_runs[w.name] else None
        report["workloads"][w.name] = {
            "requests": len(w.prompts),
            "prompt_tokens": w.prompt_tokens,
            "output_tokens": w.output_tokens,
            "engine": e.as_dict(dense) if e else None,
            "hf": h.as_dict(dense) if h else None,
            "engine_over_hf": e.output_tok_s / h.output_tok_s if e and h else None,
        }
    if bench.prefix:
        report["prefix"] = bench.prefix.as_dict()
    print_report(report)
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return report


class Bench:
    """Runs both engines; repeats after the first alternate engine and transformers runs.

    The engine runs alone first (its first pass and the prefix section), so the peak RSS then
    is the engine side's; each repeat uses fresh prompt ids of the same lengths, so a repeat
    never hits the prefix cache of an earlier one.
    """

    def __init__(self, args: argparse.Namespace, model_dir: Path, shape: ModelShape) -> None:
        self.args, self.model_dir, self.shape = args, model_dir, shape
        names = [n for n in args.workloads if n in THROUGHPUT_WORKLOADS]
        self.workloads = [
            [make_workload(n, args.num_requests, shape.vocab, rep) for n in names]
            for rep in range(args.repeats)
        ]
        self.engine_runs: dict[str, list[Run]] = {n: [] for n in names}
        self.hf_runs: dict[str, list[Run]] = {n: [] for n in names}
        self.prefix: PrefixResult | None = None
        self.rss: dict[str, float] = {}
        self.llm = None

    def run(self) -> None:
        with_hf = not self.args.skip_hf and bool(self.workloads[0])
        if not self.args.skip_engine:
            self._engine_alone(self.workloads if not with_hf else self.workloads[:1])
        if with_hf:
            self._with_hf()
        self.rss["at_end"] = peak_rss_mib()
        self.llm = None

    def _engine_alone(self, reps: list[list[Workload]]) -> None:
        start = time.perf_counter()
        self.llm = load_engine(self.model_dir, self.args)
        self.rss["engine_loaded"] = peak_rss_mib()
        print(f"engine loaded in {time.perf_counter() - start:.1f}s", flush=True)
        engine_generate(self.llm, [random_ids(random.Random(0), 8, self.shape.vocab)], [4])
        for rep in reps:
            for w in rep:
                self._engine(w)
        if "prefix" in self.args.workloads:
            self.prefix = run_prefix(self.llm, self.args.prefix_reps, self.shape.vocab)
            print(f"engine prefix: cold {self.prefix.cold:.3f}s warm {self.prefix.warm:.3f}s")
        self.rss["engine_side"] = peak_rss_mib()

    def _with_hf(self) -> None:
        model = load_hf(self.model_dir)
        rng = random.Random(0)
        vocab = self.shape.vocab
        hf_generate(model, [random_ids(rng, 8, vocab), random_ids(rng, 6, vocab)], 4)
        for i, rep in enumerate(self.workloads):
            for w in rep:
                self.hf_runs[w.name].append(_measured("transformers", w, run_hf, model, self.shape))
                if i > 0 and self.llm is not None:
                    self._engine(w)

    def _engine(self, w: Workload) -> None:
        self.engine_runs[w.name].append(_measured("engine", w, run_engine, self.llm, self.shape))


def _measured(label: str, w: Workload, fn, model, shape: ModelShape) -> Run:
    cpu = time.process_time()
    run = fn(model, w, shape)
    run.cpu_seconds = time.process_time() - cpu
    run.load_average = os.getloadavg()[0]
    print(
        f"{label} {w.name}: {run.seconds:.2f}s (cpu {run.cpu_seconds:.1f}s, "
        f"load average {run.load_average:.1f})",
        flush=True,
    )
    return run


def print_report(report: dict) -> None:
    print(
        f"\ndense fp32 matmul: {report['machine']['dense_flops_per_s'] / 1e9:.1f} GFLOP/s "
        f"({report['machine']['threads']} threads); FLOPs approximate ({report['flops_note']})\n"
    )
    rows = []
    for name, w in report["workloads"].items():
        for engine in ("engine", "hf"):
            r = w[engine]
            if r is None:
                continue
            rows.append(
                [
                    name,
                    "zerohop" if engine == "engine" else "transformers",
                    w["requests"],
                    w["prompt_tokens"],
                    w["output_tokens"],
                    "/".join(f"{x:.2f}" for x in r["all_seconds"]),
                    r["output_tok_s"],
                    r["flops_per_s"] / 1e9,
                    100 * r["flop_fraction"],
                    w["engine_over_hf"] if engine == "engine" else None,
                ]
            )
    if rows:
        print_table(
            [
                "workload",
                "engine",
                "reqs",
                "prompt tok",
                "output tok",
                "seconds (runs)",
                "best tok/s",
                "GFLOP/s",
                "% of matmul",
                "zerohop/hf",
            ],
            rows,
        )
    for name, w in report["workloads"].items():
        for engine in ("engine", "hf"):
            for note in (w[engine] or {}).get("notes", []):
                print(f"  ! {name} {engine}: {note}")
    if p := report.get("prefix"):
        print(
            f"\nprefix caching: {p['prefix_tokens']}-token prefix + {p['suffix_tokens']}-token "
            f"suffix, time to first token (median of {len(p['cold_ttft_s'])})"
        )
        print_table(
            ["request", "TTFT s", "cached tokens"],
            [
                ["cold", p["cold_median_s"], str(p["cold_cached_tokens"])],
                ["warm", p["warm_median_s"], str(p["warm_cached_tokens"])],
            ],
        )
        verdict = "hit confirmed" if p["hit_confirmed"] else "NO HIT"
        print(f"cold/warm: {p['cold_over_warm']:.1f}x (target >= 5x), {verdict}")
    rss = report["peak_rss_mib"]
    labels = {
        "engine_loaded": "engine loaded (weights + KV pool)",
        "engine_side": "engine side, before transformers loads",
        "at_end": "at the end",
    }
    print("\npeak RSS: " + ", ".join(f"{v:.0f} MiB {labels[k]}" for k, v in rss.items()))


if __name__ == "__main__":
    main()
