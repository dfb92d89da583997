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
        requests starting as others end (N requests at once would time one burst), and TTFT
        p50 (the wait of a request that arrives while others run);
  long  --long-prompt (default 2000; 0: none) prompt tokens -> 8 output tokens, one stream,
        --long-requests (3) requests: TTFT p50 of a long prefill. Each long prompt is the
        passage from a start of its own, without TextPrompts' header, and no two prompts of
        the run begin with the same token (every other prompt begins with the header's), so
        none shares a prefix with another: neither server's prompt cache can help.
Every workload counts its completed and failed requests (the "failed" column: a request that
admission control refuses with a 503 is one).
llama-server is restarted for each workload with `-np` = its concurrency (`-c` = parallel x
(input + output + 16)); zerohop serves them all from one start. --threads is a list (default:
all cores): every server runs at each thread count (`-t`/`-tb` for llama-server,
`--num-threads` for zerohop). The zerohop runs are ZEROHOP_VARIANTS below (label, weights,
extra `zerohop serve` args); --zerohop-args appends args to every one (e.g. "--quantization
q8_0"). Each zerohop run is compared with llama.cpp on the same weights file.

--baseline REF A/Bs zerohop against a commit of this repository (REF: HEAD~1, a hash...):
REF is checked out into a detached worktree ($TMPDIR/zerohop-baseline-HASH, removed at the
end, also on Ctrl-C or an error) and its C++ kernels are built once (cached under
~/.cache/zerohop/kernels by a key that includes the source path, so neither tree's build
replaces the other's; the same path for the same commit finds them built the next time).
Every zerohop run is then followed by the same `zerohop serve` from that tree, labelled
zerohop@HASH. Both servers run with PYTHONPATH and their working directory set to their own
tree. --rounds N (default 1) runs each such pair N times, alternating (current, baseline,
current, baseline...), each run its own row; llama.cpp runs once.

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
        [--concurrency 1,8,32] [--long-prompt 2000] [--baseline HEAD~1 [--rounds 3]]
        [--noisy] [--only llamacpp|zerohop] [--num-requests N] [--zerohop-args "..."]
        [--llamacpp-args "--poll 0"] [--llama-bench]

--llama-bench adds llama.cpp's own measure of its raw decode rate (no server, no client; quiet
pass only, at each thread count) to check the served TPOT against; --llamacpp-args tries
llama-server's own settings (its threads poll for work at every barrier by default, `--poll
50`, which a client on the same cores interrupts).

Prints a row per run (server, weights, threads[, noisy], with --rounds its round) with every
figure; then the "best" table, per server and weights, the best quiet figure over the thread
counts and rounds (lowest TTFT and TPOT, highest tok/s, with the thread count that gave it),
with --noisy the best noisy c=1 TPOT over the best quiet one (issue 22's target for zerohop:
within 1.5x), and a row per zerohop variant of zerohop / llama.cpp on those best figures (below
1 is better for zerohop on TTFT and TPOT, above 1 on tok/s; the baseline's rows are never
compared with llama.cpp); with --baseline, the "current / baseline" table, per (weights,
threads): each figure's ratio in each round and the median over the rounds. Writes
bench-results/vs_llamacpp.json (every run, the best rows and their ratios, the ratios at each
thread count, and `ratios_current_over_baseline`); server logs go to
bench-results/vs_llamacpp-*.log.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from _common import (
    ROOT,
    TextPrompts,
    cpu_count,
    default_model,
    int_list,
    open_model,
    print_table,
    write_json,
)
from _procstat import children, machine_busy_s, process_cpu_s
from serve import PromptMaker, Server, free_port, prompt_maker

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
LONG_OUTPUT_TOKENS = 8  # the long workload's output: its figure is the TTFT
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
        "--long-prompt", type=int, default=2000, metavar="N",
        help="prompt tokens of the long workload (one stream, 8 output tokens: TTFT p50; 0: none)",
    )  # fmt: skip
    p.add_argument("--long-requests", type=int, default=3, help="requests of the long workload")
    p.add_argument(
        "--baseline", metavar="REF",
        help="also run every zerohop server from this commit of the repository (HEAD~1, a hash)"
        ", in a temporary worktree: the 'current / baseline' table",
    )  # fmt: skip
    p.add_argument(
        "--rounds", type=int, default=1,
        help="run each zerohop server (then its baseline) this many times, each its own row",
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
    for option, low in (("--long-prompt", 0), ("--long-requests", 1), ("--rounds", 1)):
        if (given := getattr(args, option[2:].replace("-", "_"))) < low:
            p.error(f"{option}: at least {low}, not {given}")
    args.baseline_commit = baseline_commit(p, args) if args.baseline else None
    return args


def baseline_commit(p: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The full hash of the commit that --baseline names."""
    if args.only == "llamacpp":
        p.error("--baseline: the baseline is a zerohop server, and --only llamacpp runs none")
    found = git("rev-parse", "--verify", "--quiet", f"{args.baseline}^{{commit}}", check=False)
    if not found:
        p.error(f"--baseline: {args.baseline!r} names no commit of {ROOT}")
    return found


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


# -- zerohop trees: this checkout and --baseline's worktree ----------------------------------------


def git(*args: str, check: bool = True) -> str:
    """What `git -C ROOT ARGS` prints, stripped; with `check` False, "" when it fails."""
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    if done.returncode and check:
        raise SystemExit(f"git {shlex.join(args)} failed: {done.stderr.strip()}")
    return "" if done.returncode else done.stdout.strip()


@dataclass(slots=True, frozen=True)
class Tree:
    """A checkout that `zerohop serve` runs from: this one, or --baseline's worktree (its
    short commit hash in `commit`)."""

    path: Path
    commit: str | None = None

    @property
    def server(self) -> str:
        """The runs' `server`: a baseline is never taken for the zerohop compared with
        llama.cpp."""
        return "zerohop baseline" if self.commit else "zerohop"

    def label(self, variant: str) -> str:
        return f"{variant}@{self.commit}" if self.commit else variant

    def env(self) -> dict[str, str]:
        """This environment with PYTHONPATH = the tree alone: its `python -m zerohop` then
        imports the tree's code, ahead of the venv's editable install of this checkout."""
        return os.environ | {"PYTHONPATH": str(self.path)}


def prepare_tree(tree: Tree) -> None:
    """Check that `tree`'s `python -m zerohop` imports the tree's own code, and build (or
    find) its C++ kernels, so that no server start builds them."""
    where = subprocess.run(
        [sys.executable, "-c", "import zerohop; print(zerohop.__file__)"],
        cwd=tree.path, env=tree.env(), check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    if not Path(where).resolve().is_relative_to(tree.path.resolve()):
        raise SystemExit(f"{tree.path}: Python imports zerohop from {where}, not from the tree")
    print(f"{tree.label('zerohop')} ({tree.path}): ", end="", flush=True)
    kernels = [sys.executable, "-m", "zerohop.engine.kernels"]
    subprocess.run(kernels, cwd=tree.path, env=tree.env(), check=True)


@contextlib.contextmanager
def baseline_tree(commit: str | None) -> Iterator[Tree | None]:
    """`commit` checked out in a detached worktree, its kernels built, for the duration;
    removed after, also on Ctrl-C or an error. None without a commit (no --baseline)."""
    if commit is None:
        yield None
        return
    # The same path for the same commit: its kernels' cache key covers the path, so the next
    # run with this baseline finds them built.
    path = Path(tempfile.gettempdir()) / f"zerohop-baseline-{commit[:12]}"
    if path.exists():
        raise SystemExit(
            f"{path} exists: another run's baseline, or one left behind "
            f"(git worktree remove --force {path})"
        )
    try:
        git("worktree", "add", "--detach", str(path), commit)
        tree = Tree(path, git("rev-parse", "--short", commit))
        prepare_tree(tree)
        yield tree
    finally:
        remove = ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)]
        subprocess.run(remove, capture_output=True)
        if path.exists():
            print(f"! the baseline's worktree is still there: {shlex.join(remove)}")


# -- servers --------------------------------------------------------------------------------------


def llamacpp_cmd(
    bin_dir: Path, model: Path, args: argparse.Namespace, w: Workload, threads: int
) -> list[str]:
    """`llama-server` for workload `w`: a slot per stream, each with room for its tokens."""
    parallel = w.concurrency
    ctx = parallel * (w.input_tokens + w.output_tokens + 16)
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
    GET `ready_path` answers 200; run with `env` and in `cwd` (default: this process's);
    use as a context manager."""

    def __init__(
        self, cmd: list[str], ready_path: str, log: Path, env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:  # fmt: skip
        self.port = free_port()
        self.cmd = [*cmd, "--host", "127.0.0.1", "--port", str(self.port)]
        self.ready_path, self.log = ready_path, log
        self.env, self.cwd = env, cwd

    def __enter__(self) -> CommandServer:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd
            )
        start = time.monotonic()
        self.wait_ready()
        where = f" (in {self.cwd})" if self.cwd else ""
        print(f"  ready in {time.monotonic() - start:.1f}s{where}: {shlex.join(self.cmd)}")
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


@dataclass(slots=True, frozen=True)
class Workload:
    """One load-client run against a server; `name` (c1, c8, long) keys its figures."""

    name: str
    concurrency: int
    input_tokens: int
    output_tokens: int
    requests: int
    prompt_source: PromptMaker


def workloads(args: argparse.Namespace) -> list[Workload]:
    """One per --concurrency value (c=1: --one-stream-requests; else --num-requests, default
    3 x the concurrency), then the long one unless --long-prompt is 0."""
    out = []
    for c in args.concurrency:
        many = args.num_requests or STEADY_REQUESTS_PER_STREAM * c
        requests = args.one_stream_requests if c == 1 else many
        io = (args.input_tokens, args.output_tokens)
        out.append(Workload(f"c{c}", c, *io, requests, args.prompt_source))
    if args.long_prompt:
        io = (args.long_prompt, LONG_OUTPUT_TOKENS)
        out.append(Workload("long", 1, *io, args.long_requests, args.long_prompts))
    return out


class LongPrompts:
    """The long workload's `prompt_source`: the passage, wrapping around, from a start of its
    own per prompt, without TextPrompts' header. The starts are picked so that no two of
    these prompts begin with the same token, and none with the header's first token, which
    begins every other prompt of the run: no prompt shares a prefix with another, so neither
    server's prompt cache can help. Each salt (the warm-up, each chunk of the run) gets the
    same prompts whichever server asks, and no other salt's."""

    def __init__(self, text: TextPrompts, count: int) -> None:
        header = text.prompt(random.Random(0), 1)[0]
        starts: dict[int, int] = {}  # first token -> the first start that gives it
        for start, token in enumerate(text.passage):
            if token != header:
                starts.setdefault(token, start)
        if count > len(starts):
            raise SystemExit(
                f"--long-requests: at most {len(starts) - 1} (prompts beginning with a token "
                "of their own, one of them the warm-up)"
            )
        self.passage = text.passage
        self.starts = random.Random(0).sample(sorted(starts.values()), count)
        self.taken: dict[str, range] = {}  # salt -> its indices into `starts`

    def __call__(self, cfg: BenchConfig, n: int, salt: str = "") -> list[list[int]]:
        if salt not in self.taken:
            used = sum(len(r) for r in self.taken.values())
            self.taken[salt] = range(used, used + n)
        picked = self.taken[salt]
        if len(picked) != n or picked.stop > len(self.starts):
            raise ValueError(f"long prompts: {n} asked for {salt!r}, {len(self.starts)} made")
        return [self.prompt(self.starts[i], cfg.input_tokens) for i in picked]

    def prompt(self, start: int, length: int) -> list[int]:
        return list(itertools.islice(itertools.cycle(self.passage), start, start + length))


def long_prompts(args: argparse.Namespace, model: Path) -> LongPrompts | None:
    """The long workload's prompts (and its warm-up's) in `model`'s tokens; None without it."""
    if not args.long_prompt:
        return None
    _, tokenizer = open_model(model)
    return LongPrompts(TextPrompts.for_tokenizer(tokenizer), args.long_requests + 1)


def workload(
    args: argparse.Namespace, server: CommandServer, w: Workload, noisy: bool = False
) -> dict:
    """Workload `w` against `server`, with the busy loop beside it when `noisy`; the load
    client's summary."""
    cfg = BenchConfig(
        url=server.url, concurrency=w.concurrency, input_tokens=w.input_tokens,
        output_tokens=w.output_tokens, num_requests=w.requests, seed=w.concurrency,
        prompt_source=w.prompt_source,
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
    print_workload(w, summary)
    return summary


def print_workload(w: Workload, s: dict) -> None:
    ttft = p50(s["ttft_ms"]) or 0
    if w.name == "c1":
        figures = f"TTFT p50 {ttft:.1f} ms, TPOT p50 {p50(s['tpot_ms']) or 0:.2f} ms"
    elif w.name == "long":
        figures = f"TTFT p50 {ttft:.1f} ms ({w.input_tokens} prompt tokens)"
    else:
        figures = f"{s['output_throughput']:.1f} output tok/s, TTFT p50 {ttft:.0f} ms"
    if s["failed"]:
        figures += f", {s['failed']} of {s['completed'] + s['failed']} requests failed"
    cpu = s["cpu_cores"]
    noise = f", busy loop {cpu['busy_loop']:.2f} cores" if cpu["busy_loop"] else ""
    print(f"  {w.name}: {figures} (other CPU {cpu['other']:.2f} cores{noise})", flush=True)


def new_run(
    server: str, label: str, weights: str, threads: int, noisy: bool, variant: str | None = None,
    round_no: int | None = None,
) -> dict:  # fmt: skip
    """A run's record; a zerohop run's `variant` (its ZEROHOP_VARIANTS label, whichever tree)
    and `round_no` (of --rounds)."""
    name = f"{label}{' noisy' if noisy else ''}, {weights}, {threads} threads"
    print(f"\n== {name}{f', round {round_no}' if round_no else ''}", flush=True)
    return {
        "server": server, "label": label, "variant": variant or label, "round": round_no or 1,
        "weights": weights, "threads": threads, "noisy": noisy, "cmds": {}, "workloads": {},
    }  # fmt: skip


def log_path(args: argparse.Namespace, run: dict, workload: str | None = None) -> Path:
    name = "llamacpp" if run["server"] == "llama.cpp" else run["label"].replace(" ", "_")
    parts = [name, run["weights"], f"t{run['threads']}"]
    parts += [workload] if workload is not None else []
    parts += ["noisy"] if run["noisy"] else []
    parts += [f"r{run['round']}"] if args.rounds > 1 else []
    return args.out.parent / f"vs_llamacpp-{'-'.join(parts)}.log"


def run_llamacpp(
    args: argparse.Namespace, bin_dir: Path, weights: str, model: Path, threads: int, noisy: bool
) -> dict:
    """llama-server on `model` at `threads`, restarted per workload with `-np` = concurrency;
    then llama-bench's figures on a quiet pass of --llama-bench."""
    run = new_run("llama.cpp", "llama.cpp", weights, threads, noisy)
    for w in workloads(args):
        cmd = llamacpp_cmd(bin_dir, model, args, w, threads)
        with CommandServer(cmd, "/health", log_path(args, run, w.name)) as server:
            run["cmds"][w.name] = server.cmd
            run["workloads"][w.name] = workload(args, server, w, noisy)
    if args.llama_bench and not noisy:
        run["llama_bench"] = llama_bench(bin_dir, model, args, threads)
    return run


def run_zerohop(
    args: argparse.Namespace, tree: Tree, variant: tuple[str, str, list[str]], model: Path,
    threads: int, noisy: bool, round_no: int,
) -> dict:  # fmt: skip
    """One `zerohop serve` from `tree` on `model` at `threads` for every workload."""
    name, weights, extra = variant
    run = new_run(tree.server, tree.label(name), weights, threads, noisy, name, round_no)
    run["commit"] = tree.commit
    cmd = zerohop_cmd(model, args, extra, threads)
    with CommandServer(cmd, "/ready", log_path(args, run), tree.env(), tree.path) as server:
        for w in workloads(args):
            run["cmds"][w.name] = server.cmd
            run["workloads"][w.name] = workload(args, server, w, noisy)
    return run


def zerohop_runs(
    args: argparse.Namespace, trees: list[Tree], models: dict[str, Path], weights: str,
    threads: int, noisy: bool,
) -> list[dict]:  # fmt: skip
    """Every zerohop variant on `weights`: from each tree in turn (this checkout, then the
    baseline), --rounds times over."""
    runs = []
    for variant in (v for v in ZEROHOP_VARIANTS if v[1] == weights):
        for round_no in range(1, args.rounds + 1):
            for tree in trees:
                run = run_zerohop(args, tree, variant, models[weights], threads, noisy, round_no)
                runs.append(run)
    return runs


def run_pass(
    args: argparse.Namespace, bin_dir: Path | None, models: dict[str, Path], trees: list[Tree],
    noisy: bool,
) -> list[dict]:  # fmt: skip
    """Every server on every weights file at every thread count, quiet or with the busy loop."""
    runs = []
    for threads in args.threads:
        for weights in args.weights:
            if args.only != "zerohop":
                assert bin_dir is not None
                runs.append(run_llamacpp(args, bin_dir, weights, models[weights], threads, noisy))
            if args.only != "llamacpp":
                runs += zerohop_runs(args, trees, models, weights, threads, noisy)
    return runs


# -- report ---------------------------------------------------------------------------------------


def metrics(args: argparse.Namespace) -> list[tuple[str, str, bool]]:
    """(key, column header, lower is better) of each figure the workloads give."""
    out = []
    for c in args.concurrency:
        if c == 1:
            out += [("ttft_p50", "TTFT p50 ms (1)", True), ("tpot_p50", "TPOT p50 ms (1)", True)]
        else:
            out += [(f"tok_s_c{c}", f"tok/s ({c})", False)]
            out += [(f"ttft_p50_c{c}", f"TTFT p50 ms ({c})", True)]
    if args.long_prompt:
        out.append(("ttft_long_p50", f"TTFT p50 ms (long {args.long_prompt})", True))
    return out


def figures(run: dict) -> dict[str, float | None]:
    """TTFT p50 ms and TPOT p50 ms at c=1, output tokens/s and TTFT p50 ms at each c > 1
    (`tok_s_cN`, `ttft_p50_cN`), TTFT p50 ms of the long workload (`ttft_long_p50`)."""
    out: dict[str, float | None] = {}
    for name, s in run["workloads"].items():
        if name == "c1":
            out["ttft_p50"], out["tpot_p50"] = p50(s["ttft_ms"]), p50(s["tpot_ms"])
        elif name == "long":
            out["ttft_long_p50"] = p50(s["ttft_ms"])
        else:
            out[f"tok_s_{name}"] = s["output_throughput"]
            out[f"ttft_p50_{name}"] = p50(s["ttft_ms"])
    return out


def p50(distribution: dict | None) -> float | None:
    return (distribution or {}).get("p50")


def requests(run: dict, outcome: str) -> int:
    """The run's `completed` or `failed` requests, over its workloads."""
    return sum(s[outcome] for s in run["workloads"].values())


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
        names = {k: run[k] for k in ("label", "weights", "threads", "noisy", "round")}
        out.append({**names, **figs})
    return out


def baseline_ratios(runs: list[dict], keys: list[tuple[str, str, bool]]) -> list[dict]:
    """Per (variant, weights, threads, noise): this checkout's figures / the baseline's, in
    each round (the two runs one after the other) and the median over the rounds."""
    pairs: dict[tuple, dict[int, dict[str, dict]]] = {}
    for run in runs:
        if run["server"] != "llama.cpp":
            group = (run["variant"], run["weights"], run["threads"], run["noisy"])
            pairs.setdefault(group, {}).setdefault(run["round"], {})[run["server"]] = run
    out = []
    for (variant, weights, threads, noisy), rounds in pairs.items():
        if not (both := [pair for pair in rounds.values() if len(pair) == 2]):
            continue  # no --baseline
        per_round = [{"round": p["zerohop"]["round"], **pair_ratios(p, keys)} for p in both]
        out.append({
            "label": variant, "baseline": both[0]["zerohop baseline"]["label"],
            "weights": weights, "threads": threads, "noisy": noisy, "rounds": per_round,
            "median": {k: median_of([r[k] for r in per_round]) for k, _, _ in keys},
        })  # fmt: skip
    return out


def pair_ratios(pair: dict[str, dict], keys: list[tuple[str, str, bool]]) -> dict:
    """Each figure of a round's current run / its baseline run's."""
    ours, theirs = figures(pair["zerohop"]), figures(pair["zerohop baseline"])
    return {k: ratio(ours.get(k), theirs.get(k)) for k, _, _ in keys}


def median_of(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def at(best: dict | None) -> str:
    """A best figure and its thread count, for the best table."""
    if best is None:
        return "-"
    v = best["value"]
    return f"{v:.3g} @{best['threads']}t" if abs(v) < 100 else f"{v:,.0f} @{best['threads']}t"


def print_runs(
    runs: list[dict], keys: list[tuple[str, str, bool]], args: argparse.Namespace
) -> None:
    headers = ["server", "weights", "threads", *(["round"] if args.rounds > 1 else [])]
    headers += [*(h for _, h, _ in keys), "done", "failed", "other CPU (cores)"]
    headers += ["busy loop (cores)"] if args.noisy else []
    rows = []
    for r in runs:
        figs = figures(r)
        row = [f"{r['label']}{' noisy' if r['noisy'] else ''}", r["weights"], r["threads"]]
        row += [r["round"]] if args.rounds > 1 else []
        row += [figs.get(k) for k, _, _ in keys]
        row += [requests(r, "completed"), requests(r, "failed"), cores(r, "other")]
        rows.append(row + ([cores(r, "busy_loop")] if args.noisy else []))
    print_table(headers, rows)
    print("done, failed: requests over the run's workloads (a 503 of admission control fails)")
    print("other CPU: the most that processes other than the servers, this client and the busy")
    print("loop used during any of the run's workloads (noise from outside)")


def print_baseline(ratios: list[dict], keys: list[tuple[str, str, bool]]) -> None:
    headers = ["current / baseline", "weights", "threads", "round", *(h for _, h, _ in keys)]
    rows = []
    for g in ratios:
        name = f"{g['label']} / {g['baseline']}{' noisy' if g['noisy'] else ''}"
        lines = [(r["round"], r) for r in g["rounds"]]
        lines += [("median", g["median"])] if len(g["rounds"]) > 1 else []
        for round_no, figs in lines:
            row = [name, g["weights"], g["threads"], round_no]
            rows.append(row + [figs[k] for k, _, _ in keys])
    print_table(headers, rows)
    print("this checkout's figures / the baseline's, the two runs of a round one after the other:")
    print("below 1 is better for this checkout on TTFT and TPOT, above 1 on tok/s")


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


def print_report(report: dict, args: argparse.Namespace) -> None:
    keys = metrics(args)
    long = f", long: {args.long_prompt} -> {LONG_OUTPUT_TOKENS}" if args.long_prompt else ""
    print(f"\n== {args.input_tokens} prompt -> {args.output_tokens} output tokens{long}, threads "
          f"{','.join(map(str, args.threads))}")  # fmt: skip
    print_runs(report["runs"], keys, args)
    print()
    print_best(report["best"], report["ratios_zerohop_over_llamacpp"], keys, args.noisy)
    if report["ratios_current_over_baseline"]:
        print()
        print_baseline(report["ratios_current_over_baseline"], keys)


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


def zerohop_trees(args: argparse.Namespace, baseline: Tree | None) -> list[Tree]:
    """The trees zerohop runs from (none with --only llamacpp): this checkout, its kernels
    built, then the baseline's."""
    if args.only == "llamacpp":
        return []
    current = Tree(ROOT)
    prepare_tree(current)
    return [current, *([baseline] if baseline else [])]


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the running server too
    q4_1 = default_model()
    args.prompt_source, _ = prompt_maker(q4_1)  # the same text prompts for every server
    args.long_prompts = long_prompts(args, q4_1)
    cache = cache_root()
    cache.mkdir(parents=True, exist_ok=True)
    bin_dir, models = prepare_models(args, q4_1, cache)
    with baseline_tree(args.baseline_commit) as baseline:
        trees = zerohop_trees(args, baseline)
        if (load1 := os.getloadavg()[0]) > 0.5 * max(args.threads):
            print(f"! load average {load1:.2f} before starting: figures will be noisy")
        runs = run_pass(args, bin_dir, models, trees, noisy=False)
        if args.noisy:
            runs += run_pass(args, bin_dir, models, trees, noisy=True)
    report = make_report(args, bin_dir, models, runs)
    write_json(args.out, report)
    print_report(report, args)
    print(f"\nwrote {args.out}")
    return report


def make_report(
    args: argparse.Namespace, bin_dir: Path | None, models: dict[str, Path], runs: list[dict]
) -> dict:
    keys = metrics(args)
    best = best_rows(runs, keys)
    return {
        "llama_cpp_python": LLAMA_CPP_PYTHON,
        "llamacpp_bin": str(bin_dir) if bin_dir else None,
        "models": {w: str(models[w]) for w in args.weights},
        "threads": args.threads,
        "concurrency": args.concurrency,
        "noisy": args.noisy,
        "cpus": cpu_count(),
        "loadavg_at_end": os.getloadavg(),
        "workload": {k: getattr(args, k) for k in (
            "input_tokens", "output_tokens", "one_stream_requests", "num_requests",
            "long_prompt", "long_requests")} | {"long_output_tokens": LONG_OUTPUT_TOKENS},
        "zerohop_args": args.zerohop_args,
        "llamacpp_args": args.llamacpp_args,
        "head": git("rev-parse", "HEAD", check=False) or None,
        "baseline": {"ref": args.baseline, "commit": args.baseline_commit},
        "rounds": args.rounds,
        "runs": runs,
        "best": best,
        "ratios_zerohop_over_llamacpp": best_ratios(best, keys),
        "ratios_by_threads": ratios_by_threads(runs),
        "ratios_current_over_baseline": baseline_ratios(runs, keys),
    }  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
