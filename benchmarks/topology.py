"""zerohop direct (gateway built in) vs the layered stack, same model and workload, one run.

Two topologies, both up for the whole run and driven one at a time, each in front of its own
`zerohop serve` of the default model (unless --model names another) with `--threads` (1)
engine threads, so that the load client and the proxies keep a core:

  direct   client --HTTP/1.1--> zerohop serve, gateway on: a fresh key store with one tenant
           and one key, both with every limit and a token budget (too generous ever to refuse),
           audit log on, /metrics on.
  layered  client --HTTPS--> nginx --keepalive--> LiteLLM proxy (+ Redis) --> zerohop serve
           --no-gateway (harness.layered): nginx terminates TLS (self-signed) with
           `proxy_buffering off` (--nginx-buffering on: nginx's default); LiteLLM (one worker,
           pinned, in its own venv) with per-deployment rpm/tpm limits, a per-token cost and a
           global budget, Redis as its response cache (off with --no-litellm-cache) and its
           rate-limit/spend store, and per-key limits on the client's key through
           `custom_auth` (LiteLLM's virtual keys need Prisma's engines, which no package
           registry serves; custom auth with `custom_auth_run_common_checks` applies the same
           budget, model and Redis rate-limit checks).
nginx and redis-server come from Debian (installed with apt-get when missing).

Load: the `zerohop bench` client: OpenAI chat completions, streaming, the key as Bearer,
messages of random words fitted once to --input-tokens (128) on the direct server and sent
alike to both, --output-tokens (64) with `ignore_eos`, one warm-up request per run, seeded.
  capacity  closed loop, --capacity-concurrency (16) streams for --capacity-seconds (30):
            request throughput; the rates below are fractions of the direct topology's;
  rates     open loop (Poisson; --burstiness), --fractions (0.25,0.5,0.75) of that capacity,
            --run-seconds (30) of arrivals each (longer for --min-requests, up to
            --max-run-seconds), topologies in alternating order: TTFT, E2E, ITL percentiles;
  SLO       per topology, the highest rate with p95 TTFT <= --slo-ttft-ms (1000) and no
            failure: the fixed rates count as rungs, then a ladder of --ladder-step x capacity
            up to --ladder-max until one misses, then the gap is halved twice.
Per run and layer: CPU seconds per request (nginx, LiteLLM, Redis, zerohop's API and engine
processes), resident memory, Redis commands per request; "other" is the rest of the machine.

    .venv/bin/python benchmarks/topology.py [--fractions 0.25,0.5,0.75] [--run-seconds 30]
        [--slo-ttft-ms 1000] [--only direct|layered] [--out bench-results/topology.json]
Writes --out, a markdown table beside it, and every server's log as topology-*.log.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from _common import ROOT, cpu_count, model_path, print_table
from _procstat import cpu_seconds, machine_busy_s, memory_mib
from harness.layered import layered_stack
from harness.peers import LITELLM_VERSION
from harness.procs import sigterm_as_interrupt, wait_quiet
from harness.report import write_report
from harness.zerohop_server import SERVED_MODEL_NAME, ZerohopServer, gateway_flags

from zerohop.bench.http_load import LoadClient
from zerohop.bench.load import run_benchmark
from zerohop.bench.load_types import BenchConfig, StreamTimes
from zerohop.sse import Parser

TOPOLOGIES = ("direct", "layered")
LAYERS = ("nginx", "litellm", "redis", "zerohop_api", "zerohop_engine")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file, a HF folder, `standard`, `tiny`")
    p.add_argument("--threads", type=int, default=1, help="engine threads of each zerohop")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--capacity-concurrency", type=int, default=16)
    p.add_argument("--capacity-seconds", type=float, default=30.0)
    p.add_argument("--fractions", default="0.25,0.5,0.75", help="of the direct capacity")
    p.add_argument("--run-seconds", type=float, default=30.0, help="arrivals per rate run")
    p.add_argument("--min-requests", type=int, default=25, help="a run lasts for this many...")
    p.add_argument("--max-run-seconds", type=float, default=90.0, help="...up to this long")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1: Poisson")
    p.add_argument("--max-in-flight", type=int, default=512, help="open-loop concurrency cap")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="p95 TTFT objective")
    p.add_argument("--ladder-step", type=float, default=0.125, help="x capacity per rung")
    p.add_argument("--ladder-max", type=float, default=2.0, help="x capacity at most")
    p.add_argument("--ladder-seconds", type=float, default=20.0)
    p.add_argument("--no-ladder", action="store_true", help="skip the SLO ladder")
    p.add_argument("--only", choices=TOPOLOGIES, help="measure one topology only")
    p.add_argument("--nginx-buffering", choices=("off", "on"), default="off")
    p.add_argument("--no-litellm-cache", action="store_true", help="no LiteLLM response cache")
    p.add_argument("--wait-quiet", type=float, default=20.0, help="seconds, before each run")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "topology.json")
    args = p.parse_args(argv)
    args.fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
    return args


# -- the two topologies -------------------------------------------------------------------------


@dataclass
class Topology:
    name: str
    url: str
    key: str
    layers: Callable[[], dict[str, list[int]]]
    redis_port: int | None = None


def zerohop_layers(server: ZerohopServer) -> dict[str, list[int]]:
    return {"zerohop_api": [server.pid], "zerohop_engine": server.children()}


def serve_flags(args: argparse.Namespace) -> list[str]:
    return ["--num-threads", str(args.threads)]


def start_direct(
    stack: contextlib.ExitStack, model: Path, args: argparse.Namespace, tmp: Path
) -> Topology:
    print("\n== direct: zerohop serve, gateway on", flush=True)
    (tmp / "direct").mkdir()
    gateway, key = gateway_flags(tmp / "direct")
    log = args.out.parent / "topology-direct-zerohop.log"
    server = stack.enter_context(ZerohopServer(model, serve_flags(args) + gateway, log))
    return Topology("direct", server.url, key, lambda: zerohop_layers(server))


def start_layered(
    stack: contextlib.ExitStack, model: Path, args: argparse.Namespace, tmp: Path
) -> Topology:
    print(f"\n== layered: nginx (TLS) -> LiteLLM {LITELLM_VERSION} + Redis -> zerohop", flush=True)
    log = args.out.parent / "topology-layered-zerohop.log"
    flags = [*serve_flags(args), "--no-gateway"]
    server = stack.enter_context(ZerohopServer(model, flags, log))
    (tmp / "layered").mkdir()
    front = stack.enter_context(
        layered_stack(
            tmp / "layered", server.port, SERVED_MODEL_NAME, args.out.parent / "topology-layered",
            buffering=args.nginx_buffering, response_cache=not args.no_litellm_cache,
        )
    )  # fmt: skip
    layers = lambda: front.pids() | zerohop_layers(server)  # noqa: E731
    return Topology("layered", front.url, front.key, layers, front.redis_port)


def redis_commands(port: int | None) -> int:
    """Commands Redis has processed so far (INFO stats), over a raw socket."""
    if port is None:
        return 0
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"INFO stats\r\n")
        data = b""
        while b"total_commands_processed" not in data or not data.endswith(b"\r\n"):
            if not (chunk := s.recv(65536)):
                break
            data += chunk
    for line in data.decode(errors="replace").splitlines():
        if line.startswith("total_commands_processed:"):
            return int(line.split(":")[1])
    return 0


def redis_keys(port: int) -> dict[str, int]:
    """What Redis holds at the end: key counts by their first two `:`-separated fields."""
    if (cli := shutil.which("redis-cli")) is None:
        return {}
    out = subprocess.run([cli, "-p", str(port), "--scan"], capture_output=True, text=True)
    counts: dict[str, int] = {}
    for key in out.stdout.split():
        prefix = ":".join(p if len(p) < 24 else "<id>" for p in key.split(":")[:2])
        counts[prefix] = counts.get(prefix, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:30])


# -- the load -----------------------------------------------------------------------------------


class SameWords(LoadClient):
    """The load client, the same for both topologies: `Connection: close` on every request;
    the words per message fitted once (on direct, whose count_tokens counts them; LiteLLM has
    none) and kept; chat chunks read by `read_chat`, a token event being a chunk whose delta
    has text (LiteLLM's usage chunk carries an empty delta)."""

    words: int | None = None

    def __init__(self, cfg: BenchConfig, session: Any) -> None:
        super().__init__(cfg, session)
        self.headers["connection"] = "close"
        self.reader = read_chat

    async def _fit_words(self, model: str, tries: int = 4) -> int:
        if SameWords.words is None:
            SameWords.words = await super()._fit_words(model, tries)
        return SameWords.words


async def read_chat(chunks: Any, s: StreamTimes) -> None:
    """Token events and usage of an OpenAI chat stream, every chunk parsed (orjson)."""
    parser = Parser()
    async for chunk in chunks:
        for event in parser.feed(chunk):
            if not (payload := event.data):
                continue
            if payload == b"[DONE]":
                return
            data = orjson.loads(payload)
            for choice in data.get("choices") or ():
                if (choice.get("delta") or {}).get("content") or choice.get("text"):
                    s.token_event()
            if usage := data.get("usage"):
                s.prompt_tokens = usage.get("prompt_tokens") or 0
                s.output_tokens = usage.get("completion_tokens") or 0
            if error := data.get("error"):
                s.error = f"stream error: {error.get('message', error)}"


def bench_config(args: argparse.Namespace, topo: Topology, seed: int, **fields: Any) -> BenchConfig:
    return BenchConfig(
        url=topo.url, endpoint="openai-chat", input_tokens=args.input_tokens,
        output_tokens=args.output_tokens, model=SERVED_MODEL_NAME, api_key=topo.key,
        seed=seed, insecure=topo.url.startswith("https:"), **fields,
    )  # fmt: skip


def measured_run(
    args: argparse.Namespace, topo: Topology, everything: list[Topology], cfg: BenchConfig
) -> dict[str, Any]:
    """One load-client run, with the CPU of every layer of every topology around it."""
    wait_quiet(args.wait_quiet)
    pids = {t.name: t.layers() for t in everything}
    redis_before = redis_commands(topo.redis_port)
    before = {t: {k: cpu_seconds(ps) for k, ps in ls.items()} for t, ls in pids.items()}
    client0, machine0, wall0 = time.process_time(), machine_busy_s(), time.perf_counter()
    summary: dict[str, Any] = run_benchmark(cfg, client_class=SameWords)["summary"]
    wall, client = time.perf_counter() - wall0, time.process_time() - client0
    machine = machine_busy_s() - machine0
    after = {t: {k: cpu_seconds(ps) for k, ps in ls.items()} for t, ls in pids.items()}
    used = {t: {k: after[t][k] - before[t][k] for k in after[t]} for t in after}
    done = summary["completed"] + cfg.warmup_requests
    cpu = used[topo.name]
    summary["cpu_s_per_request"] = {k: v / done for k, v in cpu.items()}
    summary["cpu_s_per_request"]["total"] = sum(cpu.values()) / done
    measured = sum(v for layers in used.values() for v in layers.values())
    summary["cpu_cores_other"] = max(0.0, machine - measured - client) / wall
    summary["engine_busy"] = cpu["zerohop_engine"] / wall
    summary["memory"] = {k: memory_mib(ps) for k, ps in pids[topo.name].items()}
    commands = redis_commands(topo.redis_port) - redis_before
    summary["redis_commands_per_request"] = commands / done if topo.redis_port else None
    if summary["failed"]:
        print(f"  ! {summary['failed']} failed: {summary['errors'][:2]}")
    return summary


def line(topo: str, label: str, s: dict[str, Any]) -> str:
    ttft, e2e, itl = s["ttft_ms"] or {}, s["e2el_ms"] or {}, s["itl_ms"] or {}
    return (
        f"  {topo:<8} {label:<16} {s['completed']:>4} ok {s['failed']:>3} failed  "
        f"{s['request_throughput']:.2f} req/s  TTFT p50/p95 {ttft.get('p50', 0):.0f}/"
        f"{ttft.get('p95', 0):.0f} ms  ITL p50 {itl.get('p50', 0):.1f} ms  E2E p95 "
        f"{e2e.get('p95', 0):.0f} ms  CPU/req {s['cpu_s_per_request']['total'] * 1000:.0f} ms"
        f"  engine busy {s['engine_busy']:.2f}  other {s['cpu_cores_other']:.2f} cores"
    )


def capacity(args: argparse.Namespace, topo: Topology, everything: list[Topology]) -> dict:
    cfg = bench_config(
        args, topo, seed=1, concurrency=args.capacity_concurrency, num_requests=10**6,
        duration_s=args.capacity_seconds,
    )  # fmt: skip
    s = measured_run(args, topo, everything, cfg)
    print(line(topo.name, f"closed c={args.capacity_concurrency}", s), flush=True)
    return s


def open_loop(
    args: argparse.Namespace, topo: Topology, everything: list[Topology], rate: float,
    seconds: float, seed: int,
) -> dict[str, Any]:  # fmt: skip
    seconds = max(seconds, min(args.min_requests / rate, args.max_run_seconds))
    cfg = bench_config(
        args, topo, seed=seed, concurrency=args.max_in_flight, num_requests=10**6,
        request_rate=rate, burstiness=args.burstiness, duration_s=seconds,
    )  # fmt: skip
    s = measured_run(args, topo, everything, cfg)
    ttft = s["ttft_ms"]
    s["offered_rate"] = rate
    s["slo_met"] = bool(ttft) and not s["failed"] and ttft["p95"] <= args.slo_ttft_ms
    print(line(topo.name, f"{rate:.2f} req/s", s), flush=True)
    return s


def slo_search(
    args: argparse.Namespace, run: Callable[[float, int], dict[str, Any]], cap_rate: float,
    fixed: list[dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
    """The highest rate within the SLO: the fixed-rate runs count as rungs; if all met it,
    climb by --ladder-step x capacity until a rung misses; then halve the gap twice."""
    rungs: list[dict[str, Any]] = []
    met = [r["offered_rate"] for r in fixed if r["slo_met"]]
    missed = [r["offered_rate"] for r in fixed if not r["slo_met"]]

    def rung(rate: float) -> None:
        s = run(rate, 1000 + len(rungs)) | {"fraction": rate / cap_rate}
        rungs.append(s)
        (met if s["slo_met"] else missed).append(rate)

    x = max((r["fraction"] for r in fixed), default=0.0)
    while not missed and x + args.ladder_step <= args.ladder_max + 1e-9:
        x += args.ladder_step
        rung(x * cap_rate)
    for _ in range(2):
        low, high = max((r for r in met if r < min(missed)), default=0.0), min(missed)
        if high - low < 0.05 * cap_rate:
            break
        rung((low + high) / 2)
    sustained = max((r for r in met if not missed or r < min(missed)), default=None)
    return {"sustained_rate": sustained, "first_miss": min(missed) if missed else None,
            "ladder": rungs}  # fmt: skip


# -- report -------------------------------------------------------------------------------------


def pct(d: dict[str, float] | None, p: str) -> float | None:
    return None if not d else d.get(p)


def latency_rows(results: dict[str, Any]) -> list[list[object]]:
    rows: list[list[object]] = []
    for name, runs in results["rates"].items():
        for r in runs:
            t, e, i = r["ttft_ms"], r["e2el_ms"], r["itl_ms"]
            per = r["cpu_s_per_request"]
            front = sum(v for k, v in per.items() if k not in ("total", "zerohop_engine"))
            rows.append([
                name, r["fraction"], r["offered_rate"], r["request_throughput"], pct(t, "p50"),
                pct(t, "p95"), pct(e, "p50"), pct(e, "p95"), pct(i, "p50"), 1000 * front,
                1000 * per["total"], r["redis_commands_per_request"], r["failed"],
            ])  # fmt: skip
    return rows


LATENCY_HEADERS = ["topology", "x cap", "rate", "done/s", "TTFT p50", "TTFT p95", "E2E p50",
                   "E2E p95", "ITL p50", "front CPU ms/req", "CPU ms/req", "redis cmd/req",
                   "failed"]  # fmt: skip


def print_details(results: dict[str, Any], args: argparse.Namespace) -> None:
    print("\n== CPU ms per request by layer, and memory (MiB, RSS / peak) after the last rate")
    rows = []
    for name, runs in results["rates"].items():
        for r in runs:
            per = r["cpu_s_per_request"]
            rows.append([name, r["offered_rate"], *(1000 * per[k] if k in per else None for k in
                         LAYERS), r["engine_busy"], r["cpu_cores_other"]])  # fmt: skip
    print_table(["topology", "rate", *LAYERS, "engine busy", "other cores"], rows)
    memory = [[n, k, m["rss_mib"], m["peak_rss_mib"]] for n, runs in results["rates"].items()
              if runs for k, m in runs[-1]["memory"].items()]  # fmt: skip
    print_table(["topology", "layer", "RSS", "peak RSS"], memory)
    if results["slo"]:
        print(f"\n== highest rate within p95 TTFT <= {args.slo_ttft_ms:.0f} ms, no failures")
        print_table(
            ["topology", "sustained req/s", "x cap", "first miss req/s", "rungs"],
            [[n, s["sustained_rate"], (s["sustained_rate"] or 0) / results["capacity_rate"],
              s["first_miss"], len(s["ladder"])] for n, s in results["slo"].items()],
        )  # fmt: skip


@contextlib.contextmanager
def topologies(
    args: argparse.Namespace, model: Path, names: list[str]
) -> Iterator[dict[str, Topology]]:
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="zerohop-topology-")))
        starters = {"direct": start_direct, "layered": start_layered}
        yield {name: starters[name](stack, model, args, tmp) for name in names}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.monotonic()
    model = model_path(args.model)
    names = [args.only] if args.only else list(TOPOLOGIES)
    results: dict[str, Any] = {
        "model": str(model), "threads": args.threads, "cpus": cpu_count(),
        "workload": {"input_tokens": args.input_tokens, "output_tokens": args.output_tokens,
                     "endpoint": "openai-chat", "burstiness": args.burstiness},
        "litellm": {"version": LITELLM_VERSION, "auth": "custom_auth (no database)",
                    "response_cache": not args.no_litellm_cache},
        "nginx": {"proxy_buffering": args.nginx_buffering},
        "slo_ttft_ms": args.slo_ttft_ms, "capacity": {}, "rates": {n: [] for n in names},
        "slo": {},
    }  # fmt: skip
    with sigterm_as_interrupt(), topologies(args, model, names) as topos:
        everything = list(topos.values())
        print("\n== capacity (closed loop)", flush=True)
        for name in names:
            results["capacity"][name] = capacity(args, topos[name], everything)
        cap_rate = results["capacity_rate"] = results["capacity"][names[0]]["request_throughput"]
        print("\n== open loop at fixed rates", flush=True)
        for i, fraction in enumerate(args.fractions):
            for name in names if i % 2 == 0 else names[::-1]:
                s = open_loop(args, topos[name], everything, fraction * cap_rate,
                              args.run_seconds, seed=10 + i)  # fmt: skip
                results["rates"][name].append(s | {"fraction": fraction})
        for name in [] if args.no_ladder else names:
            topo = topos[name]
            run = lambda rate, seed, t=topo: open_loop(  # noqa: E731
                args, t, everything, rate, args.ladder_seconds, seed
            )
            results["slo"][name] = slo_search(args, run, cap_rate, results["rates"][name])
        if "layered" in topos and topos["layered"].redis_port:
            results["litellm"]["redis_keys"] = redis_keys(topos["layered"].redis_port)
    results["wall_s"] = time.monotonic() - started
    print_details(results, args)
    print(f"\n== latency vs rate (open loop; rates = fractions of {cap_rate:.2f} req/s)")
    write_report(args.out, results, LATENCY_HEADERS, latency_rows(results))
    return results


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
