"""zerohop vs llama.cpp's `llama-server` on the same GGUF files, measured by vLLM's own client.

llama.cpp is built once from source (harness.peers: the pinned llama-cpp-python sdist's
vendored llama.cpp, `llama-server` and `llama-quantize`, into `~/.cache/zerohop/llamacpp`).
Weights (--weights, default f32,q4_1): `q4_1` is the default model's shipped file; any other
name is a `llama-quantize --allow-requantize` type made from it once into the same cache
(f32, f16, bf16, q4_k_m, q6_k...).

Each server runs in turn on 127.0.0.1, driven by `vllm bench serve` (harness.vllm_bench:
OpenAI /v1/completions, streaming, the random dataset with the default model's tokenizer,
`--ignore-eos`, warm-ups first, the same seed on every server, so the same prompts):
  c=1   --input-len (128) -> --output-len (64), --prompts-per-stream x 1 requests (at least
        --min-prompts): TTFT p50 and TPOT p50;
  c=N   N streams, N x --prompts-per-stream (4) requests (a steady state): output tok/s;
  long  --long-prompt (2000; 0: none) prompt tokens -> 8, one stream, --long-requests (3):
        TTFT p50 of a long prefill.
llama-server is restarted per workload with `-np` = its concurrency; zerohop serves them all
from one start. Every server runs at each of --threads (default: all cores). The peak resident
memory of each server (VmHWM, its processes summed) is recorded.

--baseline REF also runs every zerohop server from REF (a git worktree), --rounds times,
alternating which tree goes first: the "current / baseline" table gives the rounds' medians,
their ratio and spread. --noisy runs everything again beside a busy loop (`python -c 'while
True: pass'`). --llama-bench adds llama.cpp's own raw prefill and decode rate. Before each
run the program waits (--wait-quiet, up to 300 s) for an idle machine; the "other CPU" column
is what the rest of the machine used during it: trust rows where it is near 0.

    .venv/bin/python benchmarks/vs_llamacpp.py [--threads 1,2] [--weights f32,q4_1,q4_k_m]
        [--concurrency 1,8,32] [--long-prompt 2000] [--baseline HEAD~1 [--rounds 3]]
        [--noisy] [--only llamacpp|zerohop] [--zerohop-args "..."] [--llama-bench]
Writes --out (bench-results/vs_llamacpp.json), a markdown table beside it, and every server's
log and client run under bench-results/vs_llamacpp-*.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from _common import ROOT, cpu_count, default_model, int_list
from _procstat import memory_mib, tree
from harness import ab, peers
from harness.procs import Proc, busy_loop, free_port, http_ok, wait_quiet
from harness.report import print_table, write_report
from harness.vllm_bench import BenchServe, run
from harness.zerohop_server import SERVED_MODEL_NAME, ZerohopServer

LONG_OUTPUT = 8
LLAMACPP = "llama.cpp"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", choices=("llamacpp", "zerohop"), help="run one server only")
    p.add_argument("--weights", default="f32,q4_1", help="q4_1 or llama-quantize types")
    p.add_argument("--threads", default=str(cpu_count()), help="comma-separated thread counts")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated stream counts")
    p.add_argument(
        "--skip-32", dest="concurrency", action="store_const", const="1",
        help="alias for --concurrency 1",
    )  # fmt: skip
    p.add_argument("--input-len", "--input-tokens", dest="input_len", type=int, default=128)
    p.add_argument("--output-len", "--output-tokens", dest="output_len", type=int, default=64)
    p.add_argument("--prompts-per-stream", type=int, default=4)
    p.add_argument("--min-prompts", type=int, default=8, help="requests of a workload at least")
    p.add_argument("--long-prompt", type=int, default=2000, metavar="N", help="0: none")
    p.add_argument("--long-requests", type=int, default=3)
    p.add_argument("--baseline", metavar="REF", help="A/B zerohop against this commit")
    p.add_argument("--rounds", type=int, default=1, help="zerohop runs per tree, alternating")
    p.add_argument("--noisy", action="store_true", help="run everything again beside a busy loop")
    p.add_argument("--wait-quiet", type=float, default=300.0, help="seconds, 0: do not wait")
    p.add_argument("--zerohop-args", default="", help="appended to every `zerohop serve`")
    p.add_argument("--llamacpp-args", default="", help="appended to every `llama-server`")
    p.add_argument("--llama-bench", action="store_true", help="llama.cpp's own raw rates too")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "vs_llamacpp.json")
    args = p.parse_args(argv)
    args.weights = [w.strip().lower() for w in args.weights.split(",") if w.strip()]
    args.threads = int_list(p, "--threads", args.threads)
    args.concurrency = int_list(p, "--concurrency", args.concurrency)
    if args.baseline and args.only == "llamacpp":
        p.error("--baseline: the baseline is a zerohop server, and --only llamacpp runs none")
    return args


# -- weights and workloads ----------------------------------------------------------------------


def weight_files(args: argparse.Namespace, bin_dir: Path | None) -> dict[str, Path]:
    shipped = default_model()
    return {
        w: shipped if w == "q4_1" else peers.requantized(bin_dir, shipped, w.upper())
        for w in args.weights
    }


def workloads(args: argparse.Namespace) -> list[tuple[str, int, int, int, int]]:
    """(name, concurrency, input, output, requests) of each workload."""
    out = []
    for c in args.concurrency:
        n = max(args.prompts_per_stream * c, args.min_prompts)
        out.append((f"c{c}", c, args.input_len, args.output_len, n))
    if args.long_prompt:
        out.append(("long", 1, args.long_prompt, LONG_OUTPUT, args.long_requests))
    return out


def measure(
    args: argparse.Namespace, url: str, layers: Any, w: tuple[str, int, int, int, int],
    noisy: bool, tag: str,
) -> dict[str, Any]:  # fmt: skip
    """One workload through `vllm bench serve`, with the busy loop beside it when `noisy`."""
    name, c, input_len, output_len, n = w
    bench = BenchServe(
        url, SERVED_MODEL_NAME, str(args.tokenizer), c, n, input_len, output_len,
        seed=1000 + c, warmups=min(c, 4) if name != "long" else 1,
    )  # fmt: skip
    wait_quiet(args.wait_quiet)
    with busy_loop(noisy):
        result = run(bench, args.out.parent / f"vs_llamacpp-{tag}-{name}.json", layers)
    print(f"  {name}: {line(name, result)}", flush=True)
    return result


def line(name: str, r: dict[str, Any]) -> str:
    if name == "c1":
        text = f"TTFT p50 {r['ttft_p50_ms']:.1f} ms, TPOT p50 {r['tpot_p50_ms']:.2f} ms"
    elif name == "long":
        text = f"TTFT p50 {r['ttft_p50_ms']:.1f} ms"
    else:
        text = f"{r['output_tok_s']:.1f} output tok/s, TTFT p50 {r['ttft_p50_ms']:.0f} ms"
    failed = f", {r['failed']} failed" if r["failed"] else ""
    return f"{text}{failed} (other CPU {r['cpu_cores_other'] or 0:.2f} cores)"


# -- servers ------------------------------------------------------------------------------------


def run_llamacpp(
    args: argparse.Namespace, bin_dir: Path, weights: str, model: Path, threads: int, noisy: bool
) -> dict[str, Any]:
    record = new_record(LLAMACPP, weights, threads, noisy)
    peak = 0.0
    for w in workloads(args):
        name, c, input_len, output_len, _ = w
        port = free_port()
        context = c * (input_len + output_len + 64)
        cmd = peers.llama_server_cmd(
            bin_dir, model, threads, c, context, shlex.split(args.llamacpp_args)
        )
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
        url = f"http://127.0.0.1:{port}"
        tag = tag_of(record, name)
        log = args.out.parent / f"vs_llamacpp-{tag}.log"
        with Proc(LLAMACPP, cmd, log, lambda u=url: http_ok(u + "/health")) as server:
            layers = lambda s=server: {"server": tree(s.pid)}  # noqa: E731
            record["workloads"][name] = measure(args, url, layers, w, noisy, tag)
            peak = max(peak, memory_mib(tree(server.pid))["peak_rss_mib"])
    record["peak_rss_mib"] = peak
    if args.llama_bench and not noisy:
        record["llama_bench"] = llama_bench(args, model, threads)
    return record


def run_zerohop(
    args: argparse.Namespace, side: ab.Tree, weights: str, model: Path, threads: int,
    noisy: bool, round_no: int,
) -> dict[str, Any]:  # fmt: skip
    label = "zerohop" if side.commit is None else f"zerohop@{side.commit}"
    record = new_record(label, weights, threads, noisy, round_no)
    flags = ["--no-gateway", "--num-threads", str(threads), *shlex.split(args.zerohop_args)]
    log = args.out.parent / f"vs_llamacpp-{tag_of(record)}.log"
    with ZerohopServer(model, flags, log, tree=side) as server:
        for w in workloads(args):
            tag = tag_of(record, w[0])
            record["workloads"][w[0]] = measure(args, server.url, server.pids, w, noisy, tag)
        record["peak_rss_mib"] = memory_mib(tree(server.pid))["peak_rss_mib"]
    return record


def new_record(
    server: str, weights: str, threads: int, noisy: bool, round_no: int = 1
) -> dict[str, Any]:
    print(f"\n== {server}{' noisy' if noisy else ''}, {weights}, {threads} threads, "
          f"round {round_no}", flush=True)  # fmt: skip
    return {
        "server": server, "weights": weights, "threads": threads, "noisy": noisy,
        "round": round_no, "workloads": {},
    }  # fmt: skip


def tag_of(record: dict[str, Any], workload: str | None = None) -> str:
    parts = [record["server"].replace("@", "-").replace(".", ""), record["weights"]]
    parts += [f"t{record['threads']}", f"r{record['round']}"]
    parts += ["noisy"] if record["noisy"] else []
    return "-".join(parts + ([workload] if workload else []))


def llama_bench(args: argparse.Namespace, model: Path, threads: int) -> dict[str, float]:
    """llama-bench's prompt and decode rates at `threads`, as it reports them (JSON)."""
    exe = peers.build_llamacpp(cpu_count(), ("llama-bench",)) / "llama-bench"
    cmd = [str(exe), "-m", str(model), "-t", str(threads), "-o", "json", "-r", "3"]
    cmd += ["-p", str(args.input_len), "-n", str(args.output_len)]
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    out = {f"{'prefill' if r['n_prompt'] else 'decode'}_tok_s": r["avg_ts"] for r in rows}
    print(f"  llama-bench: {out}", flush=True)
    return out


def run_pass(
    args: argparse.Namespace, bin_dir: Path | None, files: dict[str, Path], sides: list[ab.Tree],
    noisy: bool,
) -> list[dict[str, Any]]:  # fmt: skip
    records = []
    for threads in args.threads:
        for weights, model in files.items():
            if args.only != "zerohop":
                assert bin_dir is not None
                records.append(run_llamacpp(args, bin_dir, weights, model, threads, noisy))
            if args.only != "llamacpp":
                for r, side in ab.alternating(args.rounds, sides):
                    records.append(run_zerohop(args, side, weights, model, threads, noisy, r + 1))
    return records


# -- report -------------------------------------------------------------------------------------


def figures(args: argparse.Namespace) -> list[tuple[str, str, str, bool]]:
    """(column, workload, key, lower is better) of each figure."""
    out = []
    for c in args.concurrency:
        if c == 1:
            out += [("c1 TTFT ms", "c1", "ttft_p50_ms", True)]
            out += [("c1 TPOT ms", "c1", "tpot_p50_ms", True)]
        else:
            out.append((f"c{c} tok/s", f"c{c}", "output_tok_s", False))
    if args.long_prompt:
        out.append((f"{args.long_prompt}-token TTFT ms", "long", "ttft_p50_ms", True))
    return out


def value(record: dict[str, Any], workload: str, key: str) -> float | None:
    found = record["workloads"].get(workload, {}).get(key)
    return None if found is None else float(found)


def best(records: list[dict[str, Any]], args: argparse.Namespace) -> dict[tuple[str, str], dict]:
    """Per (server, weights): each figure at its best over the quiet thread counts and rounds."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in (r for r in records if not r["noisy"]):
        row = out.setdefault((r["server"], r["weights"]), {"peak_rss_mib": r["peak_rss_mib"]})
        row["peak_rss_mib"] = min(row["peak_rss_mib"], r["peak_rss_mib"])
        for column, workload, key, lower in figures(args):
            v = value(r, workload, key)
            if v is not None and (column not in row or (v < row[column]) == lower):
                row[column] = v
    return out


def ratio_rows(bests: dict[tuple[str, str], dict], args: argparse.Namespace) -> list[list]:
    columns = [f[0] for f in figures(args)] + ["peak_rss_mib"]
    rows: list[list[object]] = []
    for (server, weights), row in bests.items():
        rows.append([server, weights, *(row.get(c) for c in columns)])
        theirs = bests.get((LLAMACPP, weights))
        if server == "zerohop" and theirs:
            ratios = [row[c] / theirs[c] if row.get(c) and theirs.get(c) else None for c in columns]
            rows.append(["zerohop / llama.cpp", weights, *ratios])
    return rows


def baseline_rows(records: list[dict[str, Any]], args: argparse.Namespace) -> list[list]:
    rows: list[list[object]] = []
    quiet = [r for r in records if not r["noisy"] and r["server"].startswith("zerohop")]
    for weights in args.weights:
        for threads in args.threads:
            mine = [r for r in quiet if (r["weights"], r["threads"]) == (weights, threads)]
            for column, workload, key, _ in figures(args):
                cur = [
                    v for r in mine if r["server"] == "zerohop" and (v := value(r, workload, key))
                ]
                base = [
                    v for r in mine if r["server"] != "zerohop" and (v := value(r, workload, key))
                ]
                c = ab.compare(cur, base)
                rows.append([weights, threads, column, c["current"]["median"],
                             c["baseline"]["median"], c["ratio"], c["current"]["spread"],
                             c["baseline"]["spread"]])  # fmt: skip
    return rows


@contextlib.contextmanager
def setup(args: argparse.Namespace) -> Iterator[tuple[Path | None, dict[str, Path], list[ab.Tree]]]:
    from zerohop.models import resolve_model
    from zerohop.models.hf_export import hf_folder_for

    args.tokenizer = hf_folder_for(resolve_model(None))  # the default model's, as a folder
    needs_quantize = any(w != "q4_1" for w in args.weights)
    bin_dir = None
    if args.only != "zerohop" or needs_quantize:
        bin_dir = peers.build_llamacpp(cpu_count())
    with ab.trees(args.baseline) as sides:
        yield bin_dir, weight_files(args, bin_dir), sides


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    with setup(args) as (bin_dir, files, sides):
        records = run_pass(args, bin_dir, files, sides, noisy=False)
        if args.noisy:
            records += run_pass(args, bin_dir, files, sides, noisy=True)
    report: dict[str, Any] = {
        "client": "vllm bench serve", "cpus": cpu_count(), "runs": records,
        "files": {k: str(v) for k, v in files.items()},
        "args": {k: str(v) for k, v in vars(args).items()},
    }  # fmt: skip
    columns = ["server", "weights", *(f[0] for f in figures(args)), "peak RSS MiB"]
    if args.baseline:
        headers = ["weights", "threads", "figure", "current", "baseline", "ratio",
                   "current spread", "baseline spread"]  # fmt: skip
        report["current_over_baseline"] = rows = baseline_rows(records, args)
        print("\n== current / baseline (medians over the rounds)")
        print_table(headers, rows)
    print("\n== best quiet figure per server and weights (over threads and rounds)")
    write_report(args.out, report, columns, ratio_rows(best(records, args), args))
    return report


if __name__ == "__main__":
    main()
