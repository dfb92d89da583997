"""zerohop vs llama.cpp's `llama-server`, side by side in one run, on zerohop's default model.

llama.cpp is built once from source: the `llama-cpp-python` sdist (pinned below; it vendors
llama.cpp under `vendor/llama.cpp`) is fetched with pip into `$XDG_CACHE_HOME/zerohop/llamacpp`
(default `~/.cache/...`), and only `llama-server` and `llama-quantize` are built (Release,
GGML_NATIVE, CPU only; 10-20 minutes on 2 cores, output in `build-VERSION.log` there). Weights
(--weights, default f32,q4_1; any of f32,f16,bf16,q4_1): the default model's Q4_1 GGUF file,
and F32, F16 and BF16 GGUFs of the same weights, each made once (on first use) with
`llama-quantize --allow-requantize IN OUT F32|F16|BF16` into the same cache folder.

Each server runs in turn as a subprocess on 127.0.0.1 (a free port), driven by the `zerohop
bench` load client: OpenAI /v1/completions, streaming, prompts as token-id lists (an English
passage in the model's own tokens, `_common.TextPrompts`), greedy, `ignore_eos`, one warm-up
request first. Workloads, 128 prompt tokens -> 64 output tokens, one per --concurrency value
(default 1,8,32; --skip-32 is an alias for --concurrency 1):
  c=1   --one-stream-requests (8) requests one at a time: TTFT p50 and TPOT p50;
  c=N   N streams, --num-requests (default: 3 N) requests: output tokens/s of a steady state,
        requests starting as others end (N requests at once would time one burst).
llama-server is restarted for each workload with `-np` = its concurrency (`-c` = parallel x
(input + output + 16)); zerohop serves them all from one start. --threads is a list (default:
all cores): every server runs at each thread count (`-t`/`-tb` for llama-server,
`--num-threads` for zerohop). The zerohop runs are ZEROHOP_VARIANTS below (label, weights,
extra `zerohop serve` args); --zerohop-args appends args to every one (e.g. "--quantization
q8_0"). Each zerohop run is compared with llama.cpp on the same weights file.

--noisy runs everything a second time with a deliberate noisy neighbour: one busy loop
(`python -c "while True: pass"`, no CPU affinity) started just before each workload of that
pass (after the wait for quiet) and killed after it; those rows are labelled "noisy".

Every request opens its own connection (see FreshConnections: llama-server drops a connection
after each streamed response). Before each workload the program waits (--wait-quiet, up to
300 s) for the machine to be idle, and it measures the CPU that other processes used during
the run: the "other CPU" column, which leaves out the server, this client and the deliberate
busy loop (whose own CPU is the "busy loop" column of a --noisy run). On a shared 2-core
machine, another job on one core slows llama.cpp at 2 threads down up to a hundredfold (its
thread pool spins at every barrier), zerohop far less: trust only rows whose other CPU is near
0, or compare at --threads 1.

    .venv/bin/python benchmarks/vs_llamacpp.py [--threads 1,2] [--weights f32,f16,bf16,q4_1]
        [--concurrency 1,8,32] [--noisy] [--only llamacpp|zerohop] [--num-requests N]
        [--zerohop-args "..."] [--llamacpp-args "--poll 0"] [--llama-bench]

--llama-bench adds llama.cpp's own measure of its raw decode rate (no server, no client; quiet
pass only, at each thread count) to check the served TPOT against; --llamacpp-args tries
llama-server's own settings (its threads poll for work at every barrier by default, `--poll
50`, which a client on the same cores interrupts).

Prints two tables: one row per (server, weights, threads[, noisy]) with every figure; then the
"best" table, per server and weights, the best quiet figure over the thread counts (lowest
TTFT and TPOT at c=1, highest tok/s at each c>1, with the thread count that gave it), with
--noisy the best noisy c=1 TPOT over the best quiet one (issue 22's target for zerohop: within
1.5x), and a row per zerohop variant of zerohop / llama.cpp on those best figures (below 1 is
better for zerohop on TTFT and TPOT, above 1 on tok/s). Writes bench-results/vs_llamacpp.json
(every run, the best rows and their ratios, and the ratios at each thread count); server logs
go to bench-results/vs_llamacpp-*.log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from _common import ROOT, cpu_count, default_model, print_table, write_json
from _procstat import children, machine_busy_s, process_cpu_s
from serve import Server, free_port, prompt_maker

from zerohop.bench.http_load import LoadClient
from zerohop.bench.load import run_benchmark
from zerohop.bench.load_types import BenchConfig

if TYPE_CHECKING:
    from aiohttp import ClientSession

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp is built
WEIGHTS = ("f32", "f16", "bf16", "q4_1")
DEFAULT_WEIGHTS = ("f32", "q4_1")
FLOAT_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16"}  # made from Q4_1 by llama-quantize
# Requests per stream of a many-stream workload: enough that most of the run is a steady
# state, as vLLM's `bench serve` with --num-prompts well above --max-concurrency.
STEADY_REQUESTS_PER_STREAM = 3
# (label, weights, extra `zerohop serve` args): each is compared with llama.cpp on its weights.
ZEROHOP_VARIANTS: list[tuple[str, str, list[str]]] = [
    ("zerohop", "f32", []),
    ("zerohop", "f16", []),
    ("zerohop", "bf16", []),
    ("zerohop", "q4_1", []),
    # ("zerohop q8_0", "f32", ["--quantization", "q8_0"]),
]
BUSY_LOOP = [sys.executable, "-c", "while True: pass"]  # the noisy neighbour of --noisy
CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DBUILD_SHARED_LIBS=OFF",
]  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", choices=("llamacpp", "zerohop"), help="run one server only")
    p.add_argument(
        "--weights", default=",".join(DEFAULT_WEIGHTS), help=f"comma-separated: {','.join(WEIGHTS)}"
    )
    p.add_argument(
        "--threads", default=str(cpu_count()),
        help="comma-separated thread counts, every server runs at each (default: all cores)",
    )  # fmt: skip
    p.add_argument(
        "--concurrency", default="1,8,32",
        help="comma-separated workloads: 1 (TTFT, TPOT), N > 1 (N streams: output tok/s)",
    )  # fmt: skip
    p.add_argument(
        "--skip-32", dest="concurrency", action="store_const", const="1",
        help="alias for --concurrency 1",
    )  # fmt: skip
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--one-stream-requests", type=int, default=8)
    p.add_argument(
        "--num-requests", type=int, default=None,
        help="requests of each many-stream workload (default: 3 x its concurrency)",
    )  # fmt: skip
    p.add_argument(
        "--noisy", action="store_true",
        help="run everything again with a busy loop (`python -c 'while True: pass'`) beside",
    )  # fmt: skip
    p.add_argument(
        "--wait-quiet", type=float, default=300.0, help="before each run, wait up to this many "
        "seconds for the machine to be idle (0: do not wait)",
    )  # fmt: skip
    p.add_argument("--zerohop-args", default="", help="appended to every `zerohop serve`")
    p.add_argument(
        "--llamacpp-args", default="", help="appended to every `llama-server` (e.g. --poll 0)"
    )
    p.add_argument(
        "--llama-bench", action="store_true",
        help="also run llama.cpp's own llama-bench on each file (its raw prefill and decode"
        " rate, no server or client), built on first use",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "vs_llamacpp.json")
    args = p.parse_args(argv)
    args.weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    if unknown := set(args.weights) - set(WEIGHTS):
        p.error(f"unknown --weights {sorted(unknown)}; one of {WEIGHTS}")
    args.threads = int_list(p, "--threads", args.threads)
    args.concurrency = int_list(p, "--concurrency", args.concurrency)
    return args


def int_list(p: argparse.ArgumentParser, option: str, text: str) -> list[int]:
    """A comma-separated list of positive integers, in order, without repeats."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        p.error(f"{option}: comma-separated integers, not {text!r}")
    if not values or min(values) < 1:
        p.error(f"{option}: one or more integers >= 1, not {text!r}")
    return list(dict.fromkeys(values))


# -- llama.cpp: build and float weights -----------------------------------------------------------


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "zerohop" / "llamacpp"


def build_llamacpp(cache: Path, jobs: int) -> Path:
    """The folder of `llama-server` and `llama-quantize`, built the first time."""
    bin_dir = cache / f"build-{LLAMA_CPP_PYTHON}" / "bin"
    if all((bin_dir / name).is_file() for name in ("llama-server", "llama-quantize")):
        print(f"llama.cpp binaries: {bin_dir} (cached)")
        return bin_dir
    source = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    if not source.is_dir():
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        pip += ["-d", str(cache), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"]
        subprocess.run(pip, check=True)
        with tarfile.open(cache / f"{source.name}.tar.gz") as tar:
            tar.extractall(cache, filter="data")
    log = cache / f"build-{LLAMA_CPP_PYTHON}.log"
    print(f"building llama.cpp (10-20 min on 2 cores), log: {log}", flush=True)
    configure = ["cmake", "-S", str(source / "vendor" / "llama.cpp"), "-B", str(bin_dir.parent)]
    configure += ["-G", "Ninja", *CMAKE_OPTIONS]
    build = ["cmake", "--build", str(bin_dir.parent), "--config", "Release", "-j", str(jobs)]
    build += ["--target", "llama-server", "llama-quantize"]
    with log.open("w") as out:
        for cmd in (configure, build):
            subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=True)
    return bin_dir


def float_model_path(q4_1: Path, cache: Path, weights: str) -> Path:
    """Where the `weights` (f32, f16 or bf16) GGUF of the default model's weights is cached."""
    return cache / q4_1.name.replace(".Q4_1.", f".{FLOAT_TYPES[weights]}.")


def float_model(bin_dir: Path | None, q4_1: Path, cache: Path, weights: str) -> Path:
    """A GGUF of the default model's weights in `weights` (f32, f16 or bf16), made once with
    llama-quantize (`bin_dir` may be None once it is made)."""
    out = float_model_path(q4_1, cache, weights)
    if not out.is_file():
        assert bin_dir is not None, f"llama-quantize is needed to make {out}"
        tmp, log = out.with_suffix(".partial"), out.with_suffix(".log")
        cmd = [str(bin_dir / "llama-quantize"), "--allow-requantize", str(q4_1), str(tmp)]
        cmd.append(FLOAT_TYPES[weights])
        print(f"making {out.name} with llama-quantize, log: {log}", flush=True)
        with log.open("w") as f:
            subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True)
        tmp.rename(out)
    return out


# -- servers --------------------------------------------------------------------------------------


def llamacpp_cmd(
    bin_dir: Path, model: Path, args: argparse.Namespace, parallel: int, threads: int
) -> list[str]:
    ctx = parallel * (args.input_tokens + args.output_tokens + 16)
    return [
        str(bin_dir / "llama-server"), "-m", str(model), "-t", str(threads),
        "-tb", str(threads), "-np", str(parallel), "-c", str(ctx), "--no-webui",
        *shlex.split(args.llamacpp_args),
    ]  # fmt: skip


def llama_bench(bin_dir: Path, model: Path, args: argparse.Namespace, threads: int) -> dict:
    """llama-bench's prompt and decode rates at `threads`, as it reports them (JSON)."""
    exe = bin_dir / "llama-bench"
    if not exe.is_file():
        build = ["cmake", "--build", str(bin_dir.parent), "--config", "Release"]
        subprocess.run([*build, "--target", "llama-bench"], check=True, capture_output=True)
    cmd = [str(exe), "-m", str(model), "-t", str(threads), "-o", "json"]
    cmd += ["-p", str(args.input_tokens), "-n", str(args.output_tokens), "-r", "3"]
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    out = {}
    for row in rows:
        kind = "prefill" if row["n_prompt"] else "decode"
        out[f"{kind}_tok_s"] = row["avg_ts"]
    out["decode_ms_per_token"] = 1e3 / out["decode_tok_s"] if out.get("decode_tok_s") else None
    print(f"  llama-bench: {out}", flush=True)
    return out


def zerohop_cmd(
    model: Path, args: argparse.Namespace, extra: list[str], threads: int | None = None
) -> list[str]:
    """`zerohop serve` at `threads` (default: `args.threads`, an int for the other callers)."""
    cmd = [sys.executable, "-m", "zerohop", "serve", str(model), "--no-gateway"]
    cmd += ["--grpc-port", "0", "--num-threads", str(args.threads if threads is None else threads)]
    return cmd + extra + shlex.split(args.zerohop_args)


class CommandServer(Server):
    """A server command on 127.0.0.1 and a free port, logging to `log`, ready once
    GET `ready_path` answers 200; use as a context manager."""

    def __init__(self, cmd: list[str], ready_path: str, log: Path) -> None:
        self.port = free_port()
        self.cmd = [*cmd, "--host", "127.0.0.1", "--port", str(self.port)]
        self.ready_path, self.log = ready_path, log

    def __enter__(self) -> CommandServer:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT)
        start = time.monotonic()
        self.wait_ready()
        print(f"  ready in {time.monotonic() - start:.1f}s: {shlex.join(self.cmd)}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class CpuMeter:
    """CPU used over a run, in cores: the server (with its child processes), this load client,
    the deliberate noisy neighbour (`noise_pids`, a --noisy run's busy loop) and all the rest
    of the machine (another job on a shared machine: how noisy the run is from outside)."""

    def __init__(self, server_pid: int, noise_pids: Sequence[int] = ()) -> None:
        self.pids = [server_pid, *children(server_pid)]
        self.noise_pids = list(noise_pids)
        self.start = self._now()

    def _now(self) -> tuple[float, float, float, float, float]:
        server = sum(process_cpu_s(pid) for pid in self.pids)
        noise = sum(process_cpu_s(pid) for pid in self.noise_pids)
        return time.perf_counter(), machine_busy_s(), server, process_cpu_s(os.getpid()), noise

    def stop(self) -> dict[str, float]:
        wall, machine, server, client, noise = (
            b - a for a, b in zip(self.start, self._now(), strict=True)
        )
        other = machine - server - client - noise
        return {
            "server": server / wall, "client": client / wall, "busy_loop": noise / wall,
            "other": other / wall,
        }  # fmt: skip


@contextlib.contextmanager
def busy_loop(on: bool) -> Iterator[list[int]]:
    """With `on`, one busy-looping Python process (no CPU affinity) for the duration: its pid
    in a list; else nothing runs and the list is empty."""
    if not on:
        yield []
        return
    process = subprocess.Popen(BUSY_LOOP)
    try:
        yield [process.pid]
    finally:
        process.kill()
        process.wait()


def wait_quiet(max_wait: float, window: float = 3.0, busy: float = 0.2) -> None:
    """Wait up to `max_wait` s for a `window` in which the machine used under `busy` cores
    (the server is idle then): on a shared 2-core machine, one core busy with another job
    slows llama.cpp's spinning thread pool down up to a hundredfold at 2 threads."""
    start = time.monotonic()
    while max_wait > 0:
        before = machine_busy_s()
        time.sleep(window)
        used = (machine_busy_s() - before) / window
        if used < busy:
            return
        if time.monotonic() - start > max_wait:
            print(f"  ! still {used:.2f} cores busy after {max_wait:.0f}s of waiting: going on")
            return


# -- workloads ------------------------------------------------------------------------------------


class FreshConnections(LoadClient):
    """The load client asking for `Connection: close`: llama-server announces keep-alive but
    closes the connection after every streamed response (its chunked-content provider returns
    false after `done()`, which cpp-httplib takes as an error), and aiohttp then writes the next
    request onto the closed socket ("Can not write request body"). Both servers get it, so each
    request opens its own connection (~0.1 ms on loopback), whichever server it goes to."""

    def __init__(self, cfg: BenchConfig, session: ClientSession) -> None:
        super().__init__(cfg, session)
        self.headers["connection"] = "close"


def workload(
    args: argparse.Namespace, server: CommandServer, concurrency: int, noisy: bool = False
) -> dict:
    """One workload at `concurrency` (1: --one-stream-requests; else --num-requests, default
    3 x the concurrency), with the busy loop beside it when `noisy`; the load client's summary."""
    many = args.num_requests or STEADY_REQUESTS_PER_STREAM * concurrency
    requests = args.one_stream_requests if concurrency == 1 else many
    cfg = BenchConfig(
        url=server.url, concurrency=concurrency, input_tokens=args.input_tokens,
        output_tokens=args.output_tokens, num_requests=requests, seed=concurrency,
        prompt_source=args.prompt_source,
    )  # fmt: skip
    wait_quiet(args.wait_quiet)
    with busy_loop(noisy) as noise:
        meter = CpuMeter(server.process.pid, noise)
        summary = run_benchmark(cfg, client_class=FreshConnections)["summary"]
        summary["cpu_cores"] = cpu = meter.stop()
    if cpu["other"] > 0.25:
        print(f"  ! other processes used {cpu['other']:.2f} cores during the run: noisy figures")
    if failed := [k for k, ok in summary["checks"].items() if not ok]:
        print(f"  ! checks not met: {', '.join(failed)}; errors: {summary['errors']}")
    print_workload(concurrency, summary)
    return summary


def print_workload(concurrency: int, s: dict) -> None:
    if concurrency == 1:
        ttft, tpot = (s["ttft_ms"] or {}).get("p50"), (s["tpot_ms"] or {}).get("p50")
        figures = f"TTFT p50 {ttft or 0:.1f} ms, TPOT p50 {tpot or 0:.2f} ms"
    else:
        figures = f"{s['output_throughput']:.1f} output tok/s"
    cpu = s["cpu_cores"]
    noise = f", busy loop {cpu['busy_loop']:.2f} cores" if cpu["busy_loop"] else ""
    print(f"  c={concurrency}: {figures} (other CPU {cpu['other']:.2f} cores{noise})", flush=True)


def new_run(server: str, label: str, weights: str, threads: int, noisy: bool) -> dict:
    name = f"{label}{' noisy' if noisy else ''}, {weights}, {threads} threads"
    print(f"\n== {name}", flush=True)
    return {
        "server": server, "label": label, "weights": weights, "threads": threads,
        "noisy": noisy, "cmds": {}, "workloads": {},
    }  # fmt: skip


def log_path(args: argparse.Namespace, run: dict, np: int | None = None) -> Path:
    name = "llamacpp" if run["server"] == "llama.cpp" else run["label"].replace(" ", "_")
    parts = [name, run["weights"], f"t{run['threads']}"]
    parts += [f"np{np}"] if np is not None else []
    parts += ["noisy"] if run["noisy"] else []
    return args.out.parent / f"vs_llamacpp-{'-'.join(parts)}.log"


def run_llamacpp(
    args: argparse.Namespace, bin_dir: Path, weights: str, model: Path, threads: int, noisy: bool
) -> dict:
    """llama-server on `model` at `threads`, restarted per workload with `-np` = concurrency."""
    run = new_run("llama.cpp", "llama.cpp", weights, threads, noisy)
    for c in args.concurrency:
        cmd = llamacpp_cmd(bin_dir, model, args, c, threads)
        with CommandServer(cmd, "/health", log_path(args, run, c)) as server:
            run["cmds"][f"c{c}"] = server.cmd
            run["workloads"][f"c{c}"] = workload(args, server, c, noisy)
    return run


def run_zerohop(
    args: argparse.Namespace, label: str, weights: str, model: Path, extra: list[str],
    threads: int, noisy: bool,
) -> dict:  # fmt: skip
    """One `zerohop serve` on `model` at `threads` for every workload."""
    run = new_run("zerohop", label, weights, threads, noisy)
    cmd = zerohop_cmd(model, args, extra, threads)
    with CommandServer(cmd, "/ready", log_path(args, run)) as server:
        for c in args.concurrency:
            run["cmds"][f"c{c}"] = server.cmd
            run["workloads"][f"c{c}"] = workload(args, server, c, noisy)
    return run


def run_pass(
    args: argparse.Namespace, bin_dir: Path | None, models: dict[str, Path], noisy: bool
) -> list[dict]:
    """Every server on every weights file at every thread count, quiet or with the busy loop."""
    runs = []
    for threads in args.threads:
        for weights in args.weights:
            if args.only != "zerohop":
                assert bin_dir is not None
                runs.append(run_llamacpp(args, bin_dir, weights, models[weights], threads, noisy))
                if args.llama_bench and not noisy:
                    bench = llama_bench(bin_dir, models[weights], args, threads)
                    runs[-1]["llama_bench"] = bench
            if args.only != "llamacpp":
                for label, w, extra in ZEROHOP_VARIANTS:
                    if w == weights:
                        run = run_zerohop(args, label, w, models[w], extra, threads, noisy)
                        runs.append(run)
    return runs


# -- report ---------------------------------------------------------------------------------------


def metrics(concurrency: Sequence[int]) -> list[tuple[str, str, bool]]:
    """(key, column header, lower is better) of each figure the workloads give."""
    out = []
    if 1 in concurrency:
        out += [("ttft_p50", "TTFT p50 ms (1)", True), ("tpot_p50", "TPOT p50 ms (1)", True)]
    return out + [(f"tok_s_c{c}", f"tok/s ({c})", False) for c in concurrency if c != 1]


def figures(run: dict) -> dict[str, float | None]:
    """TTFT p50 ms and TPOT p50 ms at c=1, output tokens/s at each c > 1 (`tok_s_cN`)."""
    out: dict[str, float | None] = {}
    for name, s in run["workloads"].items():
        if name == "c1":
            out["ttft_p50"] = (s["ttft_ms"] or {}).get("p50")
            out["tpot_p50"] = (s["tpot_ms"] or {}).get("p50")
        else:
            out[f"tok_s_{name}"] = s["output_throughput"]
    return out


def cores(run: dict, key: str) -> float:
    """The most CPU (`other` or `busy_loop`) any of the run's workloads saw, in cores."""
    return max((s["cpu_cores"][key] for s in run["workloads"].values()), default=0.0)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def pick(runs: list[dict], key: str, lower: bool) -> dict | None:
    """The best `key` over `runs` (lowest or highest) and the thread count that gave it."""
    found = [(v, r["threads"]) for r in runs if (v := figures(r).get(key)) is not None]
    if not found:
        return None
    value, threads = min(found, key=lambda vt: vt[0] if lower else -vt[0])
    return {"value": value, "threads": threads}


def best_rows(runs: list[dict], keys: list[tuple[str, str, bool]]) -> list[dict]:
    """Per (label, weights): the best quiet figure of each key over the thread counts; the best
    noisy c=1 TPOT, over the best quiet one, and the same at each thread count."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["label"], run["weights"]), []).append(run)
    out = []
    for (label, weights), group in groups.items():
        quiet = [r for r in group if not r["noisy"]]
        noisy = [r for r in group if r["noisy"]]
        row = {"server": group[0]["server"], "label": label, "weights": weights}
        row |= {key: pick(quiet, key, lower) for key, _, lower in keys}
        if noisy:
            row["noisy_tpot_p50"] = best = pick(noisy, "tpot_p50", True)
            row["noisy_tpot_over_quiet"] = ratio(value(best), value(row.get("tpot_p50")))
            quiet_tpot = {r["threads"]: figures(r).get("tpot_p50") for r in quiet}
            row["noisy_tpot_over_quiet_by_threads"] = {
                r["threads"]: ratio(figures(r).get("tpot_p50"), quiet_tpot.get(r["threads"]))
                for r in noisy
            }
        out.append(row)
    return out


def value(best: dict | None) -> float | None:
    return best["value"] if best else None


def best_ratios(best: list[dict], keys: list[tuple[str, str, bool]]) -> list[dict]:
    """Each zerohop variant's best figures / llama.cpp's best on the same weights."""
    base = {r["weights"]: r for r in best if r["server"] == "llama.cpp"}
    out = []
    for row in (r for r in best if r["server"] == "zerohop" and r["weights"] in base):
        other = base[row["weights"]]
        figs = {key: ratio(value(row[key]), value(other[key])) for key, _, _ in keys}
        out.append({"label": row["label"], "weights": row["weights"], **figs})
    return out


def ratios_by_threads(runs: list[dict]) -> list[dict]:
    """Each zerohop run / llama.cpp on the same weights, threads and noise, figure by figure."""
    base = {(r["weights"], r["threads"], r["noisy"]): r for r in runs if r["server"] == "llama.cpp"}
    out = []
    for run in runs:
        key = (run["weights"], run["threads"], run["noisy"])
        if run["server"] != "zerohop" or key not in base:
            continue
        ours, theirs = figures(run), figures(base[key])
        figs = {k: ratio(v, theirs.get(k)) for k, v in ours.items()}
        names = {k: run[k] for k in ("label", "weights", "threads", "noisy")}
        out.append({**names, **figs})
    return out


def at(best: dict | None) -> str:
    """A best figure and its thread count, for the best table."""
    if best is None:
        return "-"
    v = best["value"]
    return f"{v:.3g} @{best['threads']}t" if abs(v) < 100 else f"{v:,.0f} @{best['threads']}t"


def print_runs(runs: list[dict], keys: list[tuple[str, str, bool]], noisy: bool) -> None:
    headers = ["server", "weights", "threads", *(h for _, h, _ in keys), "other CPU (cores)"]
    headers += ["busy loop (cores)"] if noisy else []
    rows = []
    for r in runs:
        figs = figures(r)
        row = [f"{r['label']}{' noisy' if r['noisy'] else ''}", r["weights"], r["threads"]]
        row += [figs.get(k) for k, _, _ in keys] + [cores(r, "other")]
        rows.append(row + ([cores(r, "busy_loop")] if noisy else []))
    print_table(headers, rows)
    print("other CPU: the most that processes other than the servers, this client and the busy")
    print("loop used during any of the run's workloads (noise from outside)")


def print_best(
    best: list[dict], ratio_rows: list[dict], keys: list[tuple[str, str, bool]], noisy: bool
) -> None:
    headers = ["best over threads", "weights", *(h for _, h, _ in keys)]
    headers += ["noisy TPOT (1)", "noisy / quiet TPOT"] if noisy else []
    rows = []
    for r in best:
        row = [r["label"], r["weights"], *(at(r[k]) for k, _, _ in keys)]
        rows.append(row + ([at(r["noisy_tpot_p50"]), r["noisy_tpot_over_quiet"]] if noisy else []))
    for r in ratio_rows:
        row = [f"{r['label']} / llama.cpp", r["weights"], *(r[k] for k, _, _ in keys)]
        rows.append(row + ([None, None] if noisy else []))
    print_table(headers, rows)
    print("@Nt: the thread count of that figure; zerohop / llama.cpp of the best figures: below 1")
    print("is better for zerohop on TTFT and TPOT, above 1 on tok/s")
    if noisy:
        print("noisy / quiet TPOT: best noisy c=1 TPOT over best quiet (issue 22: zerohop <= 1.5)")


def print_report(
    runs: list[dict], best: list[dict], ratio_rows: list[dict], args: argparse.Namespace
) -> None:
    keys = metrics(args.concurrency)
    print(f"\n== {args.input_tokens} prompt -> {args.output_tokens} output tokens, threads "
          f"{','.join(map(str, args.threads))}")  # fmt: skip
    print_runs(runs, keys, args.noisy)
    print()
    print_best(best, ratio_rows, keys, args.noisy)


def prepare_models(args: argparse.Namespace, q4_1: Path, cache: Path) -> tuple[Path | None, dict]:
    """The llama.cpp binaries (built when llama.cpp runs or a float file is still to be made;
    else None) and each --weights file."""
    floats = [w for w in args.weights if w in FLOAT_TYPES]
    missing = [w for w in floats if not float_model_path(q4_1, cache, w).is_file()]
    need_build = args.only != "zerohop" or bool(missing)
    bin_dir = build_llamacpp(cache, cpu_count()) if need_build else None
    models = {"q4_1": q4_1} | {w: float_model(bin_dir, q4_1, cache, w) for w in floats}
    print(f"models: {', '.join(f'{w} {models[w]}' for w in args.weights)}")
    return bin_dir, models


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the running server too
    q4_1 = default_model()
    args.prompt_source, _ = prompt_maker(q4_1)  # the same text prompts for every server
    cache = cache_root()
    cache.mkdir(parents=True, exist_ok=True)
    bin_dir, models = prepare_models(args, q4_1, cache)
    if (load1 := os.getloadavg()[0]) > 0.5 * max(args.threads):
        print(f"! load average {load1:.2f} before starting: figures will be noisy")
    runs = run_pass(args, bin_dir, models, noisy=False)
    if args.noisy:
        runs += run_pass(args, bin_dir, models, noisy=True)
    keys = metrics(args.concurrency)
    best = best_rows(runs, keys)
    ratio_rows = best_ratios(best, keys)
    report = {
        "llama_cpp_python": LLAMA_CPP_PYTHON,
        "llamacpp_bin": str(bin_dir) if bin_dir else None,
        "models": {w: str(models[w]) for w in args.weights},
        "threads": args.threads,
        "concurrency": args.concurrency,
        "noisy": args.noisy,
        "cpus": cpu_count(),
        "loadavg_at_end": os.getloadavg(),
        "workload": {k: getattr(args, k) for k in (
            "input_tokens", "output_tokens", "one_stream_requests", "num_requests")},
        "zerohop_args": args.zerohop_args,
        "llamacpp_args": args.llamacpp_args,
        "runs": runs,
        "best": best,
        "ratios_zerohop_over_llamacpp": ratio_rows,
        "ratios_by_threads": ratios_by_threads(runs),
    }  # fmt: skip
    write_json(args.out, report)
    print_report(runs, best, ratio_rows, args)
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
