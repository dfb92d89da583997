"""zerohop vs llama.cpp's `llama-server`, side by side in one run, on zerohop's default model.

llama.cpp is built once from source: the `llama-cpp-python` sdist (pinned below; it vendors
llama.cpp under `vendor/llama.cpp`) is fetched with pip into `$XDG_CACHE_HOME/zerohop/llamacpp`
(default `~/.cache/...`), and only `llama-server` and `llama-quantize` are built (Release,
GGML_NATIVE, CPU only; 10-20 minutes on 2 cores, output in `build-VERSION.log` there). Weights:
the default model's Q4_1 GGUF file, and an F32 GGUF of the same weights made once with
`llama-quantize --allow-requantize IN OUT F32` into the same cache folder.

Each server runs in turn as a subprocess on 127.0.0.1 (a free port), driven by the `zerohop
bench` load client: OpenAI /v1/completions, streaming, prompts as token-id lists (an English
passage in the model's own tokens, `_common.TextPrompts`), greedy, `ignore_eos`, one warm-up
request first. Workloads, 128 prompt tokens -> 64 output tokens:
  1 stream    concurrency 1, --one-stream-requests (8): TTFT p50 and TPOT p50;
  32 streams  concurrency 32, --num-requests (32): output tokens/s.
llama-server runs with `-np 1` for the first and is restarted with `-np 32` for the second
(`-c` = parallel x (input + output + 16)); zerohop serves both from one start. Both use
--threads (default: all cores). The zerohop runs are ZEROHOP_VARIANTS below (label, weights,
extra `zerohop serve` args); --zerohop-args appends args to every one (e.g. "--quantization
q8_0"). Each zerohop run is compared with llama.cpp on the same weights file.

Every request opens its own connection (see FreshConnections: llama-server drops a connection
after each streamed response). Before each run the program waits (--wait-quiet, up to 300 s)
for the machine to be idle, and it measures the CPU that other processes used during the run:
the table's last column. On a shared 2-core machine, another job on one core slows llama.cpp at
2 threads down up to a hundredfold (its thread pool spins at every barrier), zerohop far less:
trust only rows whose other CPU is near 0, or compare at --threads 1.

    .venv/bin/python benchmarks/vs_llamacpp.py [--threads 2] [--weights f32,q4_1]
        [--only llamacpp|zerohop] [--skip-32] [--num-requests 32] [--zerohop-args "..."]
        [--llamacpp-args "--poll 0"] [--llama-bench]

--llama-bench adds llama.cpp's own measure of its raw decode rate (no server, no client) to
check the served TPOT against; --llamacpp-args tries llama-server's own settings (its
threads poll for work at every barrier by default, `--poll 50`, which a client on the same
cores interrupts).

Prints the table and writes bench-results/vs_llamacpp.json; server logs go to
bench-results/vs_llamacpp-*.log.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
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
WEIGHTS = ("f32", "q4_1")
# (label, weights, extra `zerohop serve` args): each is compared with llama.cpp on its weights.
ZEROHOP_VARIANTS: list[tuple[str, str, list[str]]] = [
    ("zerohop", "f32", []),
    ("zerohop", "q4_1", []),
    # ("zerohop q8_0", "f32", ["--quantization", "q8_0"]),
]
CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DBUILD_SHARED_LIBS=OFF",
]  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", choices=("llamacpp", "zerohop"), help="run one server only")
    p.add_argument("--weights", default=",".join(WEIGHTS), help="comma-separated: f32,q4_1")
    p.add_argument("--threads", type=int, default=cpu_count(), help="threads of each server")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--one-stream-requests", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=32, help="requests of the 32-stream run")
    p.add_argument("--streams", type=int, default=32, help="concurrency of the many-stream run")
    p.add_argument("--skip-32", action="store_true", help="skip the many-stream run")
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
    return args


# -- llama.cpp: build and F32 weights -------------------------------------------------------------


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


def f32_model(bin_dir: Path, q4_1: Path, cache: Path) -> Path:
    """An F32 GGUF of the default model's weights, made once with llama-quantize."""
    out = cache / q4_1.name.replace(".Q4_1.", ".F32.")
    if not out.is_file():
        tmp, log = out.with_suffix(".partial"), out.with_suffix(".log")
        cmd = [str(bin_dir / "llama-quantize"), "--allow-requantize", str(q4_1), str(tmp), "F32"]
        print(f"making {out.name} with llama-quantize, log: {log}", flush=True)
        with log.open("w") as f:
            subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True)
        tmp.rename(out)
    return out


# -- servers --------------------------------------------------------------------------------------


def llamacpp_cmd(bin_dir: Path, model: Path, args: argparse.Namespace, parallel: int) -> list[str]:
    ctx = parallel * (args.input_tokens + args.output_tokens + 16)
    return [
        str(bin_dir / "llama-server"), "-m", str(model), "-t", str(args.threads),
        "-tb", str(args.threads), "-np", str(parallel), "-c", str(ctx), "--no-webui",
        *shlex.split(args.llamacpp_args),
    ]  # fmt: skip


def llama_bench(bin_dir: Path, model: Path, args: argparse.Namespace) -> dict:
    """llama-bench's prompt and decode rates at --threads, as it reports them (JSON)."""
    exe = bin_dir / "llama-bench"
    if not exe.is_file():
        build = ["cmake", "--build", str(bin_dir.parent), "--config", "Release"]
        subprocess.run([*build, "--target", "llama-bench"], check=True, capture_output=True)
    cmd = [str(exe), "-m", str(model), "-t", str(args.threads), "-o", "json"]
    cmd += ["-p", str(args.input_tokens), "-n", str(args.output_tokens), "-r", "3"]
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    out = {}
    for row in rows:
        kind = "prefill" if row["n_prompt"] else "decode"
        out[f"{kind}_tok_s"] = row["avg_ts"]
    out["decode_ms_per_token"] = 1e3 / out["decode_tok_s"] if out.get("decode_tok_s") else None
    print(f"  llama-bench: {out}", flush=True)
    return out


def zerohop_cmd(model: Path, args: argparse.Namespace, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "zerohop", "serve", str(model), "--no-gateway"]
    cmd += ["--grpc-port", "0", "--num-threads", str(args.threads)]
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
    and all the rest of the machine (another job on a shared machine: how noisy the run is)."""

    def __init__(self, server_pid: int) -> None:
        self.pids = [server_pid, *children(server_pid)]
        self.start = self._now()

    def _now(self) -> tuple[float, float, float, float]:
        server = sum(process_cpu_s(pid) for pid in self.pids)
        return time.perf_counter(), machine_busy_s(), server, process_cpu_s(os.getpid())

    def stop(self) -> dict[str, float]:
        wall, machine, server, client = (
            b - a for a, b in zip(self.start, self._now(), strict=True)
        )
        other = machine - server - client
        return {"server": server / wall, "client": client / wall, "other": other / wall}


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
    args: argparse.Namespace, server: CommandServer, concurrency: int, requests: int
) -> dict:
    cfg = BenchConfig(
        url=server.url, concurrency=concurrency, input_tokens=args.input_tokens,
        output_tokens=args.output_tokens, num_requests=requests, seed=concurrency,
        prompt_source=args.prompt_source,
    )  # fmt: skip
    wait_quiet(args.wait_quiet)
    meter = CpuMeter(server.process.pid)
    summary = run_benchmark(cfg, client_class=FreshConnections)["summary"]
    summary["cpu_cores"] = cpu = meter.stop()
    if cpu["other"] > 0.25:
        print(f"  ! other processes used {cpu['other']:.2f} cores during the run: noisy figures")
    if failed := [k for k, ok in summary["checks"].items() if not ok]:
        print(f"  ! checks not met: {', '.join(failed)}; errors: {summary['errors']}")
    return summary


def one_stream(args: argparse.Namespace, server: CommandServer) -> dict:
    s = workload(args, server, 1, args.one_stream_requests)
    ttft, tpot = s["ttft_ms"]["p50"], s["tpot_ms"]["p50"]
    print(f"  1 stream: TTFT p50 {ttft:.1f} ms, TPOT p50 {tpot:.2f} ms", flush=True)
    return s


def many_streams(args: argparse.Namespace, server: CommandServer) -> dict:
    s = workload(args, server, args.streams, args.num_requests)
    print(f"  {args.streams} streams: {s['output_throughput']:.1f} output tok/s", flush=True)
    return s


def run_llamacpp(args: argparse.Namespace, bin_dir: Path, weights: str, model: Path) -> dict:
    print(f"\n== llama.cpp, {weights}", flush=True)
    runs: dict = {"server": "llama.cpp", "label": "llama.cpp", "weights": weights}
    log = args.out.parent / f"vs_llamacpp-llamacpp-{weights}-np1.log"
    with CommandServer(llamacpp_cmd(bin_dir, model, args, 1), "/health", log) as server:
        runs["cmd"] = server.cmd
        runs["one_stream"] = one_stream(args, server)
    if not args.skip_32:
        log = log.with_name(log.name.replace("-np1", f"-np{args.streams}"))
        cmd = llamacpp_cmd(bin_dir, model, args, args.streams)
        with CommandServer(cmd, "/health", log) as server:
            runs["many_streams"] = many_streams(args, server)
    return runs


def run_zerohop(
    args: argparse.Namespace, label: str, weights: str, model: Path, extra: list[str]
) -> dict:
    print(f"\n== {label}, {weights}", flush=True)
    runs: dict = {"server": "zerohop", "label": label, "weights": weights}
    log = args.out.parent / f"vs_llamacpp-{label.replace(' ', '_')}-{weights}.log"
    with CommandServer(zerohop_cmd(model, args, extra), "/ready", log) as server:
        runs["cmd"] = server.cmd
        runs["one_stream"] = one_stream(args, server)
        if not args.skip_32:
            runs["many_streams"] = many_streams(args, server)
    return runs


# -- report ---------------------------------------------------------------------------------------


def figures(run: dict) -> tuple[float | None, float | None, float | None]:
    """TTFT p50 ms and TPOT p50 ms at 1 stream, output tokens/s at 32 streams."""
    one, many = run.get("one_stream"), run.get("many_streams")
    ttft = (one["ttft_ms"] or {}).get("p50") if one else None
    tpot = (one["tpot_ms"] or {}).get("p50") if one else None
    return ttft, tpot, many["output_throughput"] if many else None


def other_cores(run: dict) -> float:
    loads = (run.get(k) for k in ("one_stream", "many_streams"))
    return max(s["cpu_cores"]["other"] for s in loads if s)


def ratios(runs: list[dict]) -> list[dict]:
    """Each zerohop run / llama.cpp on the same weights, figure by figure."""
    base = {r["weights"]: figures(r) for r in runs if r["server"] == "llama.cpp"}
    out = []
    for run in (r for r in runs if r["server"] == "zerohop" and r["weights"] in base):
        pairs = zip(figures(run), base[run["weights"]], strict=True)
        values = [z / b if z is not None and b else None for z, b in pairs]
        keys = ("ttft_p50", "tpot_p50", "output_tok_s")
        ratio = dict(zip(keys, values, strict=True))
        out.append({"label": run["label"], "weights": run["weights"], **ratio})
    return out


def print_report(runs: list[dict], ratio_rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\n== {args.input_tokens} prompt -> {args.output_tokens} output tokens, "
          f"{args.threads} threads")  # fmt: skip
    headers = ["server", "weights", "TTFT p50 ms (1)", "TPOT p50 ms (1)", f"tok/s ({args.streams})"]
    rows = [[r["label"], r["weights"], *figures(r), other_cores(r)] for r in runs]
    for r in ratio_rows:
        figs = (r["ttft_p50"], r["tpot_p50"], r["output_tok_s"])
        rows.append([f"{r['label']} / llama.cpp", r["weights"], *figs, None])
    print_table([*headers, "other CPU (cores)"], rows)
    print("other CPU: the most that other processes used during either run (noise)")


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the running server too
    q4_1 = default_model()
    args.prompt_source, _ = prompt_maker(q4_1)  # the same text prompts for every server
    cache = cache_root()
    cache.mkdir(parents=True, exist_ok=True)
    f32_cached = cache / q4_1.name.replace(".Q4_1.", ".F32.")
    need_build = args.only != "zerohop" or ("f32" in args.weights and not f32_cached.is_file())
    bin_dir = build_llamacpp(cache, cpu_count()) if need_build else None
    models = {"q4_1": q4_1}
    if "f32" in args.weights:
        models["f32"] = f32_cached if bin_dir is None else f32_model(bin_dir, q4_1, cache)
    print(f"models: {', '.join(f'{w} {models[w]}' for w in args.weights)}")
    if (load1 := os.getloadavg()[0]) > 0.5 * args.threads:
        print(f"! load average {load1:.2f} before starting: figures will be noisy")
    runs = []
    for weights in args.weights:
        if args.only != "zerohop":
            runs.append(run_llamacpp(args, bin_dir, weights, models[weights]))
            if args.llama_bench:
                runs[-1]["llama_bench"] = llama_bench(bin_dir, models[weights], args)
        if args.only != "llamacpp":
            for label, w, extra in ZEROHOP_VARIANTS:
                if w == weights:
                    runs.append(run_zerohop(args, label, weights, models[weights], extra))
    ratio_rows = ratios(runs)
    report = {
        "llama_cpp_python": LLAMA_CPP_PYTHON,
        "llamacpp_bin": str(bin_dir) if bin_dir else None,
        "models": {w: str(models[w]) for w in args.weights},
        "threads": args.threads,
        "cpus": cpu_count(),
        "loadavg_at_end": os.getloadavg(),
        "workload": {k: getattr(args, k) for k in (
            "input_tokens", "output_tokens", "one_stream_requests", "num_requests", "streams")},
        "zerohop_args": args.zerohop_args,
        "llamacpp_args": args.llamacpp_args,
        "runs": runs,
        "ratios_zerohop_over_llamacpp": ratio_rows,
    }  # fmt: skip
    write_json(args.out, report)
    print_report(runs, ratio_rows, args)
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
