"""zerohop --engine vllm (gateway on) against plain `vllm serve` and against nginx -> LiteLLM
(+ Redis) -> `vllm serve`: the same model files and engine settings, vLLM's own load client.

Servers, started one at a time (each stopped before the next starts), on the same folder:

  zerohop  `zerohop serve FOLDER --engine vllm`: vLLM's AsyncLLM in zerohop's API process,
           gateway on: a fresh --keys-db with one tenant and one key (every limit and a
           budget, all too generous ever to refuse), audit log on, /metrics on; the key is
           sent as `Authorization: Bearer`.
  vllm     plain `vllm serve FOLDER` (its OpenAI server; no key).
  layered  client --HTTPS--> nginx --> LiteLLM proxy (+ Redis) --> `vllm serve FOLDER`
           (harness.layered: TLS, proxy_buffering off, keepalive upstream; LiteLLM with per-key
           limits through custom auth, a budget, Redis for its limits and spend); LiteLLM's
           Redis response cache only with --litellm-cache (vLLM's client warms up with its
           first prompt, which the cache would then answer instead of vLLM).

Every server gets the same engine settings: --dtype (auto), eager mode (--enforce-eager;
default on CPU, where torch.compile takes minutes on 2 cores, off on CUDA), --max-num-seqs
(64; zerohop passes it as `--vllm-arg max_num_seqs=N`), and on CPU a KV cache of
--kv-cache-gib (1 GiB: zerohop's `--kv-cache-memory`, vLLM's `--kv-cache-memory-bytes` and
VLLM_CPU_KVCACHE_SPACE); on CUDA both keep vLLM's --gpu-memory-utilization default. The
effective dtype, eager flag and KV cache size are read back from each server's log.

Load: `vllm bench serve` (harness.vllm_bench), streaming, the random dataset (--input-len 128,
--output-len 64, `--ignore-eos`), closed loop at each --concurrency (1,32), N = max(
--prompts-per-stream (4) x C, --min-prompts (32)) requests after C warm-ups, the same seed per
concurrency on every server, the tokenizer from the folder; --api completions (default) or
chat (on chat zerohop sends the role chunk at admission, vLLM with the first token, so chat
TTFTs are not the same event). Output tokens (requests x --output-len) are checked against
the engine's own counter on /metrics. CPU: seconds of the front process(es) per output token
(zerohop's API process; vLLM's API server; for the layered stack nginx + LiteLLM + Redis +
vLLM's API server, each also listed) and of the engine, over the client's measured window.
Ratios against plain vllm: output tok/s (x), TTFT p50 (+ms), front CPU per token (x).

    .venv/bin/python benchmarks/vllm_engine.py [--model tiny|smollm2|both] \\
        [--concurrency 1,32] [--servers zerohop,vllm,layered] [--api completions|chat]
Models: `tiny` (zerohop's random-weight test model) and `smollm2` (the default model's GGUF as
the Hugging Face folder zerohop exports once for vLLM). Writes --out, a markdown table beside
it, and every server's log and client run (vllm_engine-*). benchmarks/fairness.py --engine
vllm measures tenants under load on vLLM's scheduler.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import ROOT, cpu_count, int_list, print_table
from harness.layered import layered_stack
from harness.peers import LITELLM_VERSION, child_env, vllm_serve_cmd
from harness.procs import Proc, free_port, http_ok, sigterm_as_interrupt, wait_quiet
from harness.report import write_json, write_report
from harness.vllm_bench import APIS, BenchServe, run
from harness.zerohop_server import SERVED_MODEL_NAME, ZerohopServer, gateway_flags, metric_total

SERVERS = ("zerohop", "vllm", "layered")
MODELS = ("tiny", "smollm2")
BASELINE = "vllm"
COUNTERS = {"zerohop": "zerohop_output_tokens_total", "vllm": "vllm:generation_tokens_total"}
EFFECTIVE = {
    "dtype": re.compile(r"\bdtype=torch\.(\w+)"),
    "enforce_eager": re.compile(r"\benforce_eager=(\w+)"),
    "kv_cache_tokens": re.compile(r"KV cache size: ([\d,]+) tokens"),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=(*MODELS, "both"), default="both")
    p.add_argument("--concurrency", default="1,32", help="comma-separated stream counts")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"some of {','.join(SERVERS)}")
    p.add_argument("--api", choices=tuple(APIS), default="completions")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts-per-stream", type=int, default=4, help="N >= this x C...")
    p.add_argument("--min-prompts", type=int, default=32, help="...and at least this many")
    p.add_argument("--num-prompts", type=int, default=None, help="N for every run (overrides)")
    p.add_argument("--dtype", default="auto", help="every server's --dtype")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-gib", type=float, default=None, help="default: 1 on CPU")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for a server")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds for one client run")
    p.add_argument("--wait-quiet", type=float, default=20.0, help="seconds, before each run")
    p.add_argument("--litellm-cache", action="store_true", help="LiteLLM's response cache on")
    p.add_argument(
        "--zerohop-arg", action="append", default=[], metavar="FLAG",
        help="one more flag for zerohop serve (repeat; e.g. --zerohop-arg=--no-gateway)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "vllm_engine.json")
    args = p.parse_args(argv)
    args.concurrency = int_list(p, "--concurrency", args.concurrency)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if unknown := sorted(set(args.servers) - set(SERVERS)):
        p.error(f"--servers: unknown {', '.join(unknown)} (of {', '.join(SERVERS)})")
    args.models = list(MODELS) if args.model == "both" else [args.model]
    args.cuda = on_cuda()
    if args.enforce_eager is None:
        args.enforce_eager = not args.cuda
    if args.kv_cache_gib is None and not args.cuda:
        args.kv_cache_gib = 1.0
    return args


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


# -- servers ------------------------------------------------------------------------------------


@dataclass
class Target:
    """One server as the client sees it: URL, key, each layer's pids, the counter of the
    server that runs the engine, the engine's log."""

    url: str
    key: str | None
    layers: Callable[[], dict[str, list[int]]]
    output_tokens: Callable[[], float]
    engine_log: Path
    start_s: float = 0.0
    logs: list[Path] = field(default_factory=list)


def log_path(args: argparse.Namespace, name: str) -> Path:
    return args.out.parent / f"vllm_engine-{name}.log"


def zerohop_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--engine", "vllm", "--dtype", args.dtype]
    flags += ["--vllm-arg", f"max_num_seqs={args.max_num_seqs}"]
    flags += ["--enforce-eager"] if args.enforce_eager else []
    flags += ["--kv-cache-memory", f"{args.kv_cache_gib:g}"] if args.kv_cache_gib else []
    return flags + args.zerohop_arg


@contextlib.contextmanager
def zerohop_target(folder: Path, args: argparse.Namespace, tag: str) -> Iterator[Target]:
    with tempfile.TemporaryDirectory(prefix="zerohop-vllm-engine-") as tmp:
        gateway, key = gateway_flags(Path(tmp))
        log = log_path(args, f"{tag}-zerohop")
        flags = zerohop_flags(args) + gateway
        with ZerohopServer(folder, flags, log, timeout=args.start_timeout) as s:
            layers = lambda: {"zerohop_api": [s.pid], "engine": s.children()}  # noqa: E731
            yield Target(s.url, key, layers, s.output_tokens, log, s.start_s, [log])


@contextlib.contextmanager
def vllm_target(folder: Path, args: argparse.Namespace, tag: str) -> Iterator[Target]:
    port = free_port()
    flags = ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs)]
    flags += ["--enforce-eager"] if args.enforce_eager else []
    env = child_env()
    if args.kv_cache_gib:
        flags += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))]
        if not args.cuda:  # its CPU build's own knob, whole GiB
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(args.kv_cache_gib)))
    url = f"http://127.0.0.1:{port}"
    cmd = vllm_serve_cmd(folder, SERVED_MODEL_NAME, port, flags)
    log = log_path(args, f"{tag}-vllm")
    ready = lambda: http_ok(url + "/health")  # noqa: E731
    with Proc("vllm serve", cmd, log, ready, args.start_timeout, env=env, cwd=ROOT) as s:
        layers = lambda: {"vllm_api": [s.pid], "engine": s.children()}  # noqa: E731
        counted = lambda: metric_total(url + "/metrics", COUNTERS["vllm"])  # noqa: E731
        yield Target(url, None, layers, counted, log, s.start_s, [log])


@contextlib.contextmanager
def layered_target(folder: Path, args: argparse.Namespace, tag: str) -> Iterator[Target]:
    started = time.monotonic()
    with (
        vllm_target(folder, args, f"{tag}-layered") as upstream,
        tempfile.TemporaryDirectory(prefix="zerohop-vllm-engine-") as tmp,
    ):
        port = int(upstream.url.rsplit(":", 1)[1])
        logs = log_path(args, f"{tag}-layered").with_suffix("")
        with layered_stack(
            Path(tmp), port, SERVED_MODEL_NAME, logs, response_cache=args.litellm_cache
        ) as front:
            layers = lambda: front.pids() | upstream.layers()  # noqa: E731
            yield Target(
                front.url, front.key, layers, upstream.output_tokens, upstream.engine_log,
                time.monotonic() - started, upstream.logs + front.logs,
            )  # fmt: skip


TARGETS = {"zerohop": zerohop_target, "vllm": vllm_target, "layered": layered_target}


def effective_settings(log: Path) -> dict[str, str | None]:
    """What the engine ran with, from its log (the EngineCore's config line, its KV cache)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return {
        name: (m.group(1) if (m := pattern.search(text)) else None)
        for name, pattern in EFFECTIVE.items()
    }


# -- runs ---------------------------------------------------------------------------------------


def num_prompts(args: argparse.Namespace, concurrency: int) -> int:
    return int(args.num_prompts or max(args.prompts_per_stream * concurrency, args.min_prompts))


def measured_run(
    args: argparse.Namespace, target: Target, folder: Path, c: int, name: str
) -> dict[str, Any]:
    """One `vllm bench serve` run, its figures, the CPU of every layer per output token, and
    the engine's own output-token count against the one expected."""
    wait_quiet(args.wait_quiet)
    bench = BenchServe(
        target.url, SERVED_MODEL_NAME, str(folder), c, num_prompts(args, c), args.input_len,
        args.output_len, api=args.api, key=target.key, seed=1000 + c, timeout=args.run_timeout,
    )  # fmt: skip
    before = target.output_tokens()
    s = run(bench, args.out.parent / f"vllm_engine-{name}-c{c}.json", target.layers)
    expected = (s["completed"] + c) * args.output_len  # the warm-ups count on the server
    served = before
    for _ in range(20):  # zerohop counts a request's tokens when it ends, off the request path
        if (served := target.output_tokens() - before) >= expected:
            break
        time.sleep(0.25)
    tokens, cpu, wall = s["output_tokens"], s["cpu_s"], s["window_s"]
    front = sum(v for layer, v in cpu.items() if layer != "engine")
    s |= {
        "concurrency": c,
        "server_output_tokens": served,
        "server_output_tokens_expected": expected,
        "front_cpu_ms_per_token": 1000 * front / tokens if tokens else None,
        "engine_cpu_ms_per_token": 1000 * cpu.get("engine", 0.0) / tokens if tokens else None,
        "layer_cpu_ms_per_token": {
            k: 1000 * v / tokens if tokens else None for k, v in cpu.items()
        },
        "front_cores": front / wall if wall else None,
    }
    if served != expected:
        print(f"  ! the server counted {served:.0f} output tokens, {expected} expected")
    print(f"  {name} c={c}: {s['output_tok_s']:.1f} tok/s, TTFT p50 {s['ttft_p50_ms']:.1f} ms, "
          f"TPOT p50 {s['tpot_p50_ms']:.2f} ms, front {s['front_cpu_ms_per_token'] or 0:.3f} "
          f"ms/tok, {s['failed']} failed", flush=True)  # fmt: skip
    return s


# -- report -------------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def delta(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def report_rows(results: dict[str, Any]) -> list[list[object]]:
    rows: list[list[object]] = []
    for model, per_server in results["runs"].items():
        for c in sorted({c for runs in per_server.values() for c in runs}):
            base = per_server.get(BASELINE, {}).get(c) or {}
            for server, runs in per_server.items():
                if (s := runs.get(c)) is None:
                    continue
                rows.append([
                    model, c, server, s["output_tok_s"], s["ttft_p50_ms"], s["ttft_p99_ms"],
                    s["tpot_p50_ms"], s["front_cpu_ms_per_token"], s["engine_cpu_ms_per_token"],
                    ratio(s["output_tok_s"], base.get("output_tok_s")),
                    delta(s["ttft_p50_ms"], base.get("ttft_p50_ms")),
                    ratio(s["front_cpu_ms_per_token"], base.get("front_cpu_ms_per_token")),
                    s["failed"],
                ])  # fmt: skip
    return rows


HEADERS = ["model", "c", "server", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
           "front ms/tok", "engine ms/tok", "x tok/s", "+TTFT p50 ms", "x front CPU",
           "failed"]  # fmt: skip
LAYERS = ("nginx", "litellm", "redis", "vllm_api", "engine")


def layer_rows(results: dict[str, Any]) -> list[list[object]]:
    return [
        [model, s["concurrency"], *(s["layer_cpu_ms_per_token"].get(k) for k in LAYERS)]
        for model, per_server in results["runs"].items()
        for s in per_server.get("layered", {}).values()
    ]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.monotonic()
    results: dict[str, Any] = {
        "cpus": cpu_count(), "cuda": args.cuda, "servers": {}, "runs": {},
        "engine_settings": {k: getattr(args, k) for k in
                            ("dtype", "enforce_eager", "max_num_seqs", "kv_cache_gib")},
        "workload": {"client": "vllm bench serve", "api": args.api, "dataset": "random",
                     "input_len": args.input_len, "output_len": args.output_len,
                     "num_prompts": {c: num_prompts(args, c) for c in args.concurrency}},
        "litellm": {"version": LITELLM_VERSION, "response_cache": args.litellm_cache},
    }  # fmt: skip
    for model in args.models:
        folder = model_folder(model)
        print(f"\n== {model}: {folder}", flush=True)
        runs, servers = (
            results["runs"].setdefault(model, {}),
            results["servers"].setdefault(model, {}),
        )
        for name in args.servers:
            print(f"-- {name}", flush=True)
            with sigterm_as_interrupt(), TARGETS[name](folder, args, model) as target:
                runs[name] = {
                    c: measured_run(args, target, folder, c, f"{model}-{name}")
                    for c in args.concurrency
                }
                servers[name] = {
                    "start_s": target.start_s, "effective": effective_settings(target.engine_log),
                    "logs": [str(p) for p in target.logs],
                }  # fmt: skip
            write_json(args.out, results)  # so far: a stopped run keeps what it measured
        if len({str(s["effective"]) for s in servers.values()}) > 1:
            print(f"  ! the engines ran with different settings: {servers}")
    results["wall_s"] = time.monotonic() - started
    if rows := layer_rows(results):
        print("\n== layered: front CPU ms per output token by layer")
        print_table(["model", "c", *LAYERS], rows)
    print(f"\n== vLLM's engine behind three fronts ({args.input_len} -> {args.output_len} "
          "tokens, closed loop; ratios vs plain vllm)")  # fmt: skip
    write_report(args.out, results, HEADERS, report_rows(results))
    return results


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
