"""Offline throughput of the zerohop engine against Hugging Face transformers, side by side,
each on the same weights, for two models (--models, default both, one child process each):
  standard  the standard benchmark Llama (~125M parameters, random weights, toy tokenizer)
  default   zerohop's default model, SmolLM2-135M-Instruct (GGUF, dequantized to float32)

Workloads (prompts cut from an English passage in the model's own tokens, greedy, eos ignored,
exact output lengths):
  uniform  N requests, 128 prompt tokens and 32 output tokens each
  mixed    N requests, prompt lengths uniform in 16..256, output lengths uniform in 8..128
  prefix   time to first token of a 1,024-token prefix + 16-token suffix, cold vs warm
           (prefix cached by an earlier request), engine only

transformers runs each workload as people use it: one left-padded static batch, padded to the
longest prompt, `max_new_tokens` = the largest request; only the tokens each request asked for
count, for both engines. The engine runs alone first, so the peak RSS then is the engine side's;
with --repeats > 1 (default 2) later runs alternate the engines and the fastest run counts.

    .venv/bin/python benchmarks/engine_throughput.py [--models standard,default] [--skip-hf]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _common import (
    ModelShape,
    TextPrompts,
    cpu_count,
    ensure_model,
    measure_matmul,
    model_path,
    open_model,
    peak_rss_mib,
    print_table,
    set_threads,
    write_json,
)
from _engine_work import (
    SEED,
    Run,
    Workload,
    best_of,
    hf_generate,
    load_hf,
    make_workload,
    run_hf,
    workload_flops,
)

MODELS = ("standard", "default")
THROUGHPUT_WORKLOADS = ("uniform", "mixed")
PREFIX_TOKENS = 1024
SUFFIX_TOKENS = 16


# -- the zerohop engine ------------------------------------------------------------------------


def load_engine(model: Path, args: argparse.Namespace):
    from zerohop import LLM

    return LLM(
        str(model),
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


def run_prefix(llm, reps: int, prompts: TextPrompts) -> PrefixResult:
    """Each rep: a fresh prefix, cold with one suffix, then warm with another (max_tokens=1)."""
    rng = random.Random(f"{SEED}-prefix")
    result = PrefixResult()
    for _ in range(reps):
        prefix = prompts.prompt(rng, PREFIX_TOKENS)
        for times, cached in (
            (result.cold_ttft_s, result.cold_cached_tokens),
            (result.warm_ttft_s, result.warm_cached_tokens),
        ):
            seconds, outs = engine_generate(llm, [prefix + prompts.prompt(rng, SUFFIX_TOKENS)], [1])
            times.append(seconds)
            cached.append(outs[0].cached_tokens or 0)
    return result


# -- the program -------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--models", default=",".join(MODELS), help="standard, default or both")
    parser.add_argument("--workloads", default="uniform,mixed,prefix")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--model-dir", type=Path, default=None, help="the standard model's folder")
    parser.add_argument(
        "--default-model",
        type=Path,
        default=None,
        help="the default model's .gguf file or folder (default: zerohop's default model)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/engine_throughput.json"))
    parser.add_argument("--skip-hf", action="store_true", help="engine only")
    parser.add_argument("--skip-engine", action="store_true", help="transformers only")
    parser.add_argument("--threads", type=int, default=cpu_count(), help="torch threads, both")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs per workload and engine (best counts)"
    )
    parser.add_argument("--prefix-reps", type=int, default=3, help="cold/warm pairs (median)")
    # Set on the child process that measures one model of a multi-model run.
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.models = _names(parser, "models", args.models, MODELS)
    args.workloads = _names(parser, "workloads", args.workloads, (*THROUGHPUT_WORKLOADS, "prefix"))
    if min(args.num_requests, args.repeats, args.prefix_reps, args.threads) < 1:
        parser.error("--num-requests, --repeats, --prefix-reps and --threads must be >= 1")
    return args


def _names(
    parser: argparse.ArgumentParser, option: str, value: str, known: Sequence[str]
) -> list[str]:
    names = list(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    if unknown := set(names) - set(known):
        parser.error(f"unknown {option}: {', '.join(sorted(unknown))}")
    if not names:
        parser.error(f"--{option}: name at least one of {', '.join(known)}")
    return names


def dense_flops_per_s() -> tuple[float, list[dict]]:
    results = measure_matmul()
    return max(r.flops_per_s for r in results), [asdict(r) for r in results]


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if len(args.models) == 1:
        models = {args.models[0]: measure(args, args.models[0])}
    else:
        models = {name: measure_in_child(argv, name, args.out) for name in args.models}
    report = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "models": models}
    write_json(args.out, report)
    if not args.child:
        print_report(report)
        print(f"\nwrote {args.out}")
    return report


def measure_in_child(argv: Sequence[str] | None, name: str, out: Path) -> dict:
    """One model's figures, measured in a process of its own: ru_maxrss only ever grows, so
    in one process the second model's peak RSS would be the first one's."""
    part = out.with_name(f"{out.stem}.{name}.part{out.suffix}")
    argv = list(sys.argv[1:] if argv is None else argv)
    print(f"\n== model {name}", flush=True)
    # argparse keeps the last value of an option given twice.
    cmd = [sys.executable, __file__, *argv, "--models", name, "--out", str(part), "--child"]
    done = subprocess.run(cmd, check=False)
    if done.returncode != 0 or not part.exists():
        print(f"model {name}: the measuring process failed (exit status {done.returncode})")
        return {"error": f"measuring process exit status {done.returncode}"}
    report = json.loads(part.read_text())["models"][name]
    part.unlink()
    return report


def measure(args: argparse.Namespace, name: str) -> dict:
    """Both engines on one model, in this process."""
    path = ensure_model(args.model_dir) if name == "standard" else model_path(args.default_model)
    set_threads(args.threads)
    dense_before, matmul_before = dense_flops_per_s()
    print(
        f"model {name}: {path}, {args.threads} threads, dense fp32 matmul "
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
    bench = Bench(args, path)
    bench.run()
    dense_after, matmul_after = dense_flops_per_s()
    dense = max(dense_before, dense_after)
    shape = bench.shape
    report = {
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
            "name": name,
            "path": str(path),
            **(asdict(shape) if shape else {}),
            "non_embedding_params": shape.non_embedding_params() if shape else None,
            "prompts": "an English passage cut to length, in the model's own tokens",
        },
        "engine_options": {
            "max_num_seqs": 64,
            "kv_cache_memory_gib": 2.0,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
        "repeats": args.repeats,
        "flops_note": "approximate: 2*params per fed token (lm_head only at sampled positions) "
        "+ 4*heads*head_dim*context per layer for attention; norms/softmax left out",
        "workloads": {},
        "hf_error": bench.hf_error,
        "peak_rss_mib": bench.rss,
    }
    for w in bench.workloads[0] if bench.workloads else []:
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
    return report


class Bench:
    """Runs both engines on one model; repeats after the first alternate engine and
    transformers runs.

    The engine runs alone first (its first pass and the prefix section), so the peak RSS then
    is the engine side's; each repeat uses fresh prompts of the same lengths, so a repeat
    never hits the prefix cache of an earlier one. The model's shape (for FLOPs) and tokenizer
    (for prompts) come from the engine once loaded, else from the model's files.
    """

    def __init__(self, args: argparse.Namespace, path: Path) -> None:
        self.args, self.path = args, path
        self.names = [n for n in args.workloads if n in THROUGHPUT_WORKLOADS]
        self.shape: ModelShape | None = None
        self.prompts: TextPrompts | None = None
        self.workloads: list[list[Workload]] = []
        self.engine_runs: dict[str, list[Run]] = {n: [] for n in self.names}
        self.hf_runs: dict[str, list[Run]] = {n: [] for n in self.names}
        self.prefix: PrefixResult | None = None
        self.rss: dict[str, float] = {}
        self.llm = None
        self.hf_error: str | None = None

    def run(self) -> None:
        with_hf = not self.args.skip_hf and bool(self.names)
        if not self.args.skip_engine:
            self._engine_alone(self.args.repeats if not with_hf else 1)
        if with_hf:
            self._with_hf()
        self.rss["at_end"] = peak_rss_mib()
        self.llm = None

    def _prepare(self, config, tokenizer) -> None:
        self.shape = ModelShape.from_config(config)
        self.prompts = TextPrompts.for_tokenizer(tokenizer)
        self.workloads = [
            [make_workload(n, self.args.num_requests, self.prompts, rep) for n in self.names]
            for rep in range(self.args.repeats)
        ]

    def _engine_alone(self, passes: int) -> None:
        start = time.perf_counter()
        self.llm = load_engine(self.path, self.args)
        self.rss["engine_loaded"] = peak_rss_mib()
        print(f"engine loaded in {time.perf_counter() - start:.1f}s", flush=True)
        self._prepare(self.llm.engine.model_config, self.llm.tokenizer)
        engine_generate(self.llm, [self.prompts.prompt(random.Random(0), 8)], [4])
        for rep in self.workloads[:passes]:
            for w in rep:
                self._engine(w)
        if "prefix" in self.args.workloads:
            self.prefix = run_prefix(self.llm, self.args.prefix_reps, self.prompts)
            print(f"engine prefix: cold {self.prefix.cold:.3f}s warm {self.prefix.warm:.3f}s")
        self.rss["engine_side"] = peak_rss_mib()

    def _with_hf(self) -> None:
        if self.prompts is None:
            self._prepare(*open_model(self.path))
        model = self._load_hf()
        if model is not None:
            rng = random.Random(0)
            hf_generate(model, [self.prompts.prompt(rng, 8), self.prompts.prompt(rng, 6)], 4)
        for i, rep in enumerate(self.workloads):
            for w in rep:
                if model is not None:
                    run = _measured("transformers", w, run_hf, model, self.shape)
                    self.hf_runs[w.name].append(run)
                if i > 0 and self.llm is not None:
                    self._engine(w)

    def _load_hf(self):
        """transformers' model, or None (and the reason kept) when it cannot load this one:
        the engine's figures still count."""
        start = time.perf_counter()
        try:
            model = load_hf(self.path)
        except (ImportError, OSError, ValueError) as exc:  # e.g. a package GGUF loading needs
            self.hf_error = f"{type(exc).__name__}: {exc}"
            print(f"transformers cannot load the model: {self.hf_error}", flush=True)
            return None
        print(f"transformers loaded in {time.perf_counter() - start:.1f}s", flush=True)
        return model

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


# -- the report --------------------------------------------------------------------------------


def print_report(report: dict) -> None:
    for name, model in report["models"].items():
        if "error" in model:
            print(f"\n== model {name}: no figures ({model['error']})")
        else:
            print_model(name, model)
    if len(report["models"]) > 1:
        print_side_by_side(report["models"])


def print_model(name: str, report: dict) -> None:
    m = report["model"]
    print(f"\n== model {name}: {m['path']}")
    if "hidden" in m:
        print(
            f"hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads / {m['kv_heads']} "
            f"KV heads of {m['head_dim']}, intermediate {m['intermediate']}, vocab {m['vocab']}"
            f"{', tied embeddings' if m['tied_embeddings'] else ''}"
        )
    print(
        f"dense fp32 matmul: {report['machine']['dense_flops_per_s'] / 1e9:.1f} GFLOP/s "
        f"({report['machine']['threads']} threads); FLOPs approximate ({report['flops_note']})\n"
    )
    rows = []
    for workload, w in report["workloads"].items():
        for engine in ("engine", "hf"):
            r = w[engine]
            if r is None:
                continue
            rows.append([
                workload, "zerohop" if engine == "engine" else "transformers", w["requests"],
                w["prompt_tokens"], w["output_tokens"],
                "/".join(f"{x:.2f}" for x in r["all_seconds"]), r["output_tok_s"],
                r["flops_per_s"] / 1e9, 100 * r["flop_fraction"],
                w["engine_over_hf"] if engine == "engine" else None,
            ])  # fmt: skip
    if rows:
        print_table(
            ["workload", "engine", "reqs", "prompt tok", "output tok", "seconds (runs)",
             "best tok/s", "GFLOP/s", "% of matmul", "zerohop/hf"],
            rows,
        )  # fmt: skip
    for workload, w in report["workloads"].items():
        for engine in ("engine", "hf"):
            for note in (w[engine] or {}).get("notes", []):
                print(f"  ! {workload} {engine}: {note}")
    if report["hf_error"]:
        print(f"  ! transformers could not load the model: {report['hf_error']}")
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


def print_side_by_side(models: dict[str, dict]) -> None:
    print("\n== side by side (best runs)")
    rows = []
    for name, m in models.items():
        for workload, w in m.get("workloads", {}).items():
            e, h = w["engine"], w["hf"]
            rows.append([
                name, workload, e["output_tok_s"] if e else None,
                h["output_tok_s"] if h else None, w["engine_over_hf"],
                100 * e["flop_fraction"] if e else None,
            ])  # fmt: skip
    if rows:
        print_table(
            ["model", "workload", "zerohop tok/s", "hf tok/s", "zerohop/hf", "zerohop % matmul"],
            rows,
        )
    if prefix := {n: m["prefix"] for n, m in models.items() if m.get("prefix")}:
        ratios = ", ".join(f"{n} {p['cold_over_warm']:.1f}x" for n, p in prefix.items())
        print(f"prefix caching, cold/warm TTFT: {ratios}")


if __name__ == "__main__":
    # Read when tqdm is imported: quiets transformers' progress bar over the GGUF's tensors.
    os.environ.setdefault("TQDM_DISABLE", "1")
    main()
