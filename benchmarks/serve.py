"""Served vs offline, side by side in one run, on zerohop's default model.

The model is SmolLM2-135M-Instruct (GGUF) unless --model-dir names another: a .gguf file, a
Hugging Face folder, `standard` (engine_throughput.py's standard model) or `tiny`.

Prompts, offline and served alike, are cut from an English passage in the model's own tokens
(`_common.TextPrompts`, handed to the load client as `BenchConfig.prompt_source`).
For each engine thread count in --threads (default 1,2):
  offline  `LLM.generate` of N requests x 128 prompt tokens x 64 output tokens (greedy, eos
           ignored) -> output tokens/s; and the prefill time of one 128-token request
           (`max_tokens=1`, median of --prefill-reps, each prompt new to the prefix cache);
  served   `zerohop serve MODEL --num-threads T` as a subprocess with the same engine options,
           driven by the `zerohop bench` load client (OpenAI /v1/completions, streaming):
             throughput      concurrency N, the same prompts as offline;
             latency         the same at concurrency N with logprobs=0 (see below);
             ttft            concurrency 1, 128 in / 8 out, logprobs=0;
             ttft_one_token  concurrency 1, 128 in / 1 out: the offline prefill's request.
           The server sends one chunk per token even when its text is empty (a token in the
           middle of a UTF-8 character; most tokens of the standard model, whose toy tokenizer
           covers 512 of its 32,000 ids); logprobs=0 is kept on the latency runs as a check
           that every token's chunk carries its own entry.
--repeats rounds (default 2) alternate the thread counts; each figure counts at its best round
(highest throughput, lowest prefill and TTFT), as a shared machine only ever slows runs down.
Targets: served / offline throughput >= 0.90; TTFT at c=1 - offline prefill <= 5 ms.

    .venv/bin/python benchmarks/serve.py [--threads 1,2] [--out bench-results/serve.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import ROOT, TextPrompts, cpu_count, model_path, open_model, print_table, write_json
from _procstat import children, process_cpu_s
from engine_throughput import engine_generate, load_engine

from zerohop.bench.load import run_benchmark
from zerohop.bench.load_types import BenchConfig
from zerohop.bench.metrics import format_report
from zerohop.bench.prompts import make_prompts

SERVED_MODEL_NAME = "bench"
THROUGHPUT_TARGET = 0.90
TTFT_GAP_TARGET_MS = 5.0
RUNS = ("throughput", "latency", "ttft", "ttft_one_token")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model-dir",
        default=None,
        help="a .gguf file or a Hugging Face folder, or `standard` (the standard benchmark "
        "model) or `tiny` (default: zerohop's default model, SmolLM2-135M-Instruct)",
    )
    p.add_argument("--threads", default="1,2", help="engine torch threads to try, comma-separated")
    p.add_argument("--num-requests", type=int, default=32, help="requests = concurrency")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--ttft-requests", type=int, default=10, help="requests at concurrency 1")
    p.add_argument("--ttft-output-tokens", type=int, default=8)
    p.add_argument("--prefill-reps", type=int, default=10)
    p.add_argument(
        "--repeats", type=int, default=2, help="rounds over the thread counts; best counts"
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--py-spy",
        action="store_true",
        help="profile the server's API and engine processes during the throughput run",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "serve.json")
    return p.parse_args(argv)


PromptMaker = Callable[[BenchConfig, int, str], list[list[int]]]


def prompt_maker(model: Path) -> tuple[PromptMaker, int]:
    """A `BenchConfig.prompt_source` of text through the model's own tokenizer, and the
    model's vocabulary size (for the record: BenchConfig.vocab_size then goes unused)."""
    config, tokenizer = open_model(model)
    text = TextPrompts.for_tokenizer(tokenizer)

    def make(cfg: BenchConfig, n: int, salt: str = "") -> list[list[int]]:
        """an English passage cut to length, in the model's own tokens"""
        rng = random.Random(f"{cfg.seed}-{salt}")
        shared = min(cfg.shared_prefix_tokens, cfg.input_tokens)
        prefix = text.prompt(rng, shared) if shared else []
        return [prefix + text.prompt(rng, cfg.input_tokens - shared) for _ in range(n)]

    return make, config.vocab_size


def load_config(
    args: argparse.Namespace, url: str, *, concurrency: int, requests: int, output_tokens: int,
    seed: int, **fields: Any,
) -> BenchConfig:  # fmt: skip
    """A load-client run of `args.input_tokens`-token text prompts against the served model;
    `fields`: the other BenchConfig fields (logprobs, api_key, vocab_size...)."""
    return BenchConfig(
        url=url,
        concurrency=concurrency,
        input_tokens=args.input_tokens,
        output_tokens=output_tokens,
        num_requests=requests,
        model=SERVED_MODEL_NAME,
        seed=seed,
        prompt_source=args.prompt_source,
        **fields,
    )


def workload(
    args: argparse.Namespace, url: str, vocab: int, seed: int = 0, logprobs: int | None = None
) -> BenchConfig:
    return load_config(
        args, url, concurrency=args.num_requests, requests=args.num_requests,
        output_tokens=args.output_tokens, seed=seed, vocab_size=vocab, logprobs=logprobs,
    )  # fmt: skip


def ttft_workload(
    args: argparse.Namespace, url: str, vocab: int, output_tokens: int, logprobs: int | None
) -> BenchConfig:
    return load_config(
        args, url, concurrency=1, requests=args.ttft_requests, output_tokens=output_tokens,
        seed=100 + output_tokens,  # not the earlier runs' prompts, now in the prefix cache
        vocab_size=vocab, logprobs=logprobs,
    )  # fmt: skip


# -- offline ------------------------------------------------------------------------------------


def run_offline(args: argparse.Namespace, model: Path, threads: int, vocab: int) -> dict:
    engine_args = argparse.Namespace(
        max_num_batched_tokens=args.max_num_batched_tokens, threads=threads
    )
    llm = load_engine(model, engine_args)
    cfg = workload(args, "", vocab)
    warm = make_prompts(cfg, 2, "offline-warmup")
    engine_generate(llm, warm, [8, 8])
    prompts = make_prompts(cfg, args.num_requests, "bench")
    seconds, outs = engine_generate(llm, prompts, [args.output_tokens] * len(prompts))
    produced = sum(len(o.token_ids) for o in outs)
    prefill = []
    for rep in range(args.prefill_reps):
        prompt = make_prompts(cfg, 1, f"prefill-{rep}")
        prefill.append(engine_generate(llm, prompt, [1])[0])
    del llm, outs
    gc.collect()
    return {
        "seconds": seconds,
        "output_tokens": produced,
        "output_throughput": produced / seconds,
        "prefill_s": prefill,
        "prefill_median_ms": 1000 * statistics.median(prefill),
    }


# -- served -------------------------------------------------------------------------------------


class Server:
    """`zerohop serve` on a free port, with the offline engine's options."""

    ready_path = "/ready"  # answers 200 once the server can take requests

    def __init__(self, args: argparse.Namespace, model: Path, threads: int, log: Path):
        self.port = free_port()
        self.log = log
        cmd = [
            sys.executable, "-m", "zerohop", "serve", str(model),
            "--port", str(self.port), "--grpc-port", "0",
            "--served-model-name", SERVED_MODEL_NAME, "--num-threads", str(threads),
            # engine_throughput.load_engine's options:
            "--max-num-seqs", "64", "--kv-cache-memory", "2.0",
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        ]  # fmt: skip
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited early; log: {self.log}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=1.0) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout}s; log: {self.log}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_served(args: argparse.Namespace, model: Path, threads: int, vocab: int) -> dict:
    log = args.out.parent / f"serve-server-t{threads}.log"
    server = Server(args, model, threads, log)
    try:
        start = time.perf_counter()
        server.wait_ready()
        print(f"  server ready in {time.perf_counter() - start:.1f}s (pid {server.process.pid})")
        profiler = Profiler(server.process.pid, args.out.parent, threads) if args.py_spy else None
        cpu = CpuMeter(server.process.pid)
        runs = {"throughput": run_benchmark(workload(args, server.url, vocab))}
        cpu_used = cpu.stop()
        profile = profiler.stop() if profiler else None
        # A token without text (most of the standard model's, whose tokenizer covers 512 of
        # its 32,000 ids) gets no chunk of its own unless it carries logprobs: the latency
        # runs ask for logprobs=0; the throughput run does not (its figures need no events).
        runs["latency"] = run_benchmark(workload(args, server.url, vocab, seed=1, logprobs=0))
        ttft = ttft_workload(args, server.url, vocab, args.ttft_output_tokens, logprobs=0)
        runs["ttft"] = run_benchmark(ttft)
        # max_tokens=1 without logprobs: its one chunk comes with the first token, and it is
        # the offline prefill measurement's request.
        runs["ttft_one_token"] = run_benchmark(ttft_workload(args, server.url, vocab, 1, None))
        for name, report in runs.items():
            print(f"-- {name}")
            print(format_report(report))
    finally:
        server.stop()
    return runs | {"server_log": str(log), "py_spy": profile, "cpu_during_throughput": cpu_used}


class CpuMeter:
    """CPU seconds of the API process, the engine process and this load client over a run."""

    def __init__(self, server_pid: int) -> None:
        self.pids = server_pids(server_pid)
        self.start = self._now()

    def _now(self) -> dict[str, float]:
        out = {"wall": time.perf_counter(), "client": time.process_time()}
        for name, pid in self.pids.items():
            out[name] = process_cpu_s(pid)
        return out

    def stop(self) -> dict[str, float]:
        end = self._now()
        return {f"{k}_s": end[k] - self.start[k] for k in end}


# -- profiling (--py-spy) ---------------------------------------------------------------------


class Profiler:
    """py-spy on the server's API process and engine process while a run lasts (raw stacks,
    on-CPU samples only): samples / rate = CPU seconds, and the hottest frames of each."""

    RATE = 100

    def __init__(self, server_pid: int, out_dir: Path, threads: int) -> None:
        pids = server_pids(server_pid)
        self.files = {name: out_dir / f"serve-pyspy-{name}-t{threads}.txt" for name in pids}
        self.procs = [self._record(pid, self.files[name]) for name, pid in pids.items()]
        self.start = time.perf_counter()

    def stop(self) -> dict:
        seconds = time.perf_counter() - self.start
        for proc in self.procs:
            proc.send_signal(signal.SIGINT)
        for proc in self.procs:
            proc.wait(60)
        return {
            name: summarize_stacks(path, seconds, self.RATE) for name, path in self.files.items()
        }

    def _record(self, pid: int, out: Path) -> subprocess.Popen:
        py_spy = str(Path(sys.executable).with_name("py-spy"))
        cmd = [py_spy, "record", "--nonblocking", "-r", str(self.RATE), "-f", "raw"]
        cmd += ["-p", str(pid), "-o", str(out)]
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def server_pids(server_pid: int) -> dict[str, int]:
    """The API process (the `zerohop serve` process itself) and its engine process."""
    pids = {"api": server_pid}
    if engines := children(server_pid, marker="engine_process"):
        pids["engine"] = engines[0]
    return pids


def summarize_stacks(path: Path, seconds: float, rate: int, top: int = 12) -> dict:
    """CPU share and the top self-time frames from py-spy's raw (collapsed) output."""
    frames: dict[str, int] = {}
    total = 0
    if path.exists():
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            n = int(count)
            total += n
            leaf = stack.rsplit(";", 1)[-1]
            frames[leaf] = frames.get(leaf, 0) + n
    hottest = sorted(frames.items(), key=lambda kv: -kv[1])[:top]
    return {
        "file": str(path),
        "seconds": seconds,
        "cpu_fraction": total / (rate * seconds) if seconds else 0.0,
        "top_self": [{"frame": f, "share": n / total} for f, n in hottest] if total else [],
    }


# -- report -------------------------------------------------------------------------------------


def compare(offline: dict, served: dict) -> dict:
    s = served["throughput"]["summary"]
    ttft = served["ttft"]["summary"]
    # TTFT of the 128-in/8-out run is the first token's only if every token had its event.
    source = "ttft" if ttft["checks"]["one_event_per_token"] else "ttft_one_token"
    ttft_p50 = (served[source]["summary"]["ttft_ms"] or {}).get("p50")
    gap = None if ttft_p50 is None else ttft_p50 - offline["prefill_median_ms"]
    return {
        "offline_output_throughput": offline["output_throughput"],
        "served_output_throughput": s["output_throughput"],
        "served_over_offline": s["output_throughput"] / offline["output_throughput"],
        "offline_prefill_ms": offline["prefill_median_ms"],
        "served_ttft_c1_p50_ms": ttft_p50,
        "ttft_source": source,
        "ttft_8_tokens_p50_ms": (ttft["ttft_ms"] or {}).get("p50"),
        "ttft_one_token_p50_ms": (served["ttft_one_token"]["summary"]["ttft_ms"] or {}).get("p50"),
        "ttft_minus_prefill_ms": gap,
        "c32_latency_p50_ms": {
            k: (served["latency"]["summary"][k] or {}).get("p50")
            for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
        },
        "latency_run_output_throughput": served["latency"]["summary"]["output_throughput"],
        "served_failed": sum(served[k]["summary"]["failed"] for k in RUNS),
        "served_checks": {k: served[k]["summary"]["checks"] for k in RUNS},
    }


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    model = model_path(args.model_dir)
    args.prompt_source, vocab = prompt_maker(model)
    report = measure(args, model, vocab)
    print_summary(report)
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return report


def measure(args: argparse.Namespace, model: Path, vocab: int) -> dict:
    threads = [int(t) for t in args.threads.split(",")]
    runs: dict[str, dict] = {str(t): {"repeats": []} for t in threads}
    for rep in range(args.repeats):  # alternate thread counts; the best repeat counts
        for t in threads:
            print(f"\n== engine threads {t}, repeat {rep + 1}: offline", flush=True)
            offline = run_offline(args, model, t, vocab)
            print(
                f"  {offline['output_throughput']:.1f} output tok/s ({offline['seconds']:.2f}s), "
                f"prefill {offline['prefill_median_ms']:.1f} ms",
                flush=True,
            )
            print(f"== engine threads {t}, repeat {rep + 1}: served", flush=True)
            served = run_served(args, model, t, vocab)
            repeat = {"offline": offline, "served": served, "compare": compare(offline, served)}
            runs[str(t)]["repeats"].append(repeat)
    for run in runs.values():
        run["compare"] = best_of([r["compare"] for r in run["repeats"]])
    return {
        "model": str(model),
        "prompts": "an English passage cut to length, in the model's own tokens",
        "cpus": cpu_count(),
        "workload": {
            "requests": args.num_requests,
            "concurrency": args.num_requests,
            "input_tokens": args.input_tokens,
            "output_tokens": args.output_tokens,
            "ttft_requests": args.ttft_requests,
            "ttft_output_tokens": args.ttft_output_tokens,
            "repeats": args.repeats,
        },
        "targets": {"served_over_offline": THROUGHPUT_TARGET, "ttft_gap_ms": TTFT_GAP_TARGET_MS},
        "runs": runs,
        "best": best(runs),
    }


def best_of(compares: list[dict]) -> dict:
    """Each figure at its best over the repeats (a shared machine only ever slows a run down):
    the highest throughputs, the lowest prefill and TTFT; the rest from the fastest served run."""
    out = dict(max(compares, key=lambda c: c["served_output_throughput"]))
    offline = max(c["offline_output_throughput"] for c in compares)
    served = max(c["served_output_throughput"] for c in compares)
    prefill = min(c["offline_prefill_ms"] for c in compares)
    ttfts = [c["served_ttft_c1_p50_ms"] for c in compares if c["served_ttft_c1_p50_ms"]]
    ttft = min(ttfts) if ttfts else None
    out |= {
        "offline_output_throughput": offline,
        "served_output_throughput": served,
        "served_over_offline": served / offline,
        "offline_prefill_ms": prefill,
        "served_ttft_c1_p50_ms": ttft,
        "ttft_minus_prefill_ms": None if ttft is None else ttft - prefill,
        "served_failed": sum(c["served_failed"] for c in compares),
        "per_repeat": {
            k: [c[k] for c in compares]
            for k in (
                "offline_output_throughput",
                "served_output_throughput",
                "offline_prefill_ms",
                "served_ttft_c1_p50_ms",
            )
        },
    }
    return out


def best(runs: dict[str, dict]) -> dict:
    """Best served thread count vs best offline thread count (each at its own best)."""
    served_t = max(runs, key=lambda t: runs[t]["compare"]["served_output_throughput"])
    offline_t = max(runs, key=lambda t: runs[t]["compare"]["offline_output_throughput"])
    served = runs[served_t]["compare"]["served_output_throughput"]
    offline = runs[offline_t]["compare"]["offline_output_throughput"]
    return {
        "served_threads": int(served_t),
        "offline_threads": int(offline_t),
        "served_over_best_offline": served / offline,
    }


def print_summary(report: dict) -> None:
    print("\n== served vs offline")
    rows = []
    for t, run in report["runs"].items():
        c = run["compare"]
        rows.append(
            [
                t,
                c["offline_output_throughput"],
                c["served_output_throughput"],
                c["served_over_offline"],
                c["offline_prefill_ms"],
                c["served_ttft_c1_p50_ms"],
                c["ttft_minus_prefill_ms"],
                c["served_failed"],
            ]
        )
    print_table(
        [
            "engine threads",
            "offline tok/s",
            "served tok/s",
            "served/offline",
            "prefill ms",
            "TTFT c=1 p50 ms",
            "TTFT - prefill ms",
            "failed",
        ],
        rows,
    )
    b = report["best"]
    print(
        f"best served ({b['served_threads']} engine threads) / best offline "
        f"({b['offline_threads']} threads): {b['served_over_best_offline']:.3f} "
        f"(target >= {THROUGHPUT_TARGET}); TTFT gap target <= {TTFT_GAP_TARGET_MS} ms"
    )
    for t, run in report["runs"].items():
        for name, checks in run["compare"]["served_checks"].items():
            # Without logprobs, tokens without text (most of the standard model's) have no event.
            expected = {"one_event_per_token"} if name in ("throughput", "ttft_one_token") else ()
            if failed := [k for k, ok in checks.items() if not ok and k not in expected]:
                print(f"  ! threads {t}, {name} run: checks not met: {', '.join(failed)}")
        for r in run["repeats"]:
            cpu = r["served"]["cpu_during_throughput"]
            shares = ", ".join(
                f"{k[:-2]} {100 * v / cpu['wall_s']:.0f}%" for k, v in cpu.items() if k != "wall_s"
            )
            print(f"  threads {t}: CPU during the throughput run (of one core): {shares}")
        c = run["compare"]
        lat = ", ".join(
            f"{k[:-3].upper()} {v:.1f}" for k, v in c["c32_latency_p50_ms"].items() if v
        )
        print(f"  threads {t}: TTFT at c=1 from the {c['ttft_source']} run; p50 ms at c=N: {lat}")
        profiles = (r["served"]["py_spy"] or {} for r in run["repeats"])
        for name, prof in (item for p in profiles for item in p.items()):
            print(f"  py-spy {name} process: {100 * prof['cpu_fraction']:.0f}% of a core; top:")
            for frame in prof["top_self"][:6]:
                print(f"    {100 * frame['share']:5.1f}%  {frame['frame']}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
