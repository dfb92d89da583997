"""vLLM's own load client, `vllm bench serve`, as a child process: streaming, the random
dataset (exact prompt and output lengths, `--ignore-eos`), closed loop at one concurrency,
warm-up requests first, the tokenizer from the model's folder or file.

CPU is counted between the client's "Starting main benchmark run" line and its result header
(read from its stdout), so the client's start and warm-up are outside the window. Per-request
TTFT, TPOT and end-to-end percentiles come from its detailed result (--save-detailed).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import ROOT
from _procstat import cpu_seconds, machine_busy_s, process_cpu_s

from harness.peers import child_env, vllm_cli

START_MARK = "Starting main benchmark run"
RESULT_MARK = "Serving Benchmark Result"
APIS = {  # backend and endpoint of each API
    "completions": ("openai", "/v1/completions"),
    "chat": ("openai-chat", "/v1/chat/completions"),
}


@dataclass(slots=True)
class BenchServe:
    """One `vllm bench serve` run's settings."""

    url: str
    model: str
    tokenizer: str
    concurrency: int
    num_prompts: int
    input_len: int = 128
    output_len: int = 64
    api: str = "completions"
    key: str | None = None
    seed: int = 0
    warmups: int | None = None  # default: one per stream
    timeout: float = 1800.0

    def command(self, result: Path) -> list[str]:
        backend, endpoint = APIS[self.api]
        warmups = self.concurrency if self.warmups is None else self.warmups
        cmd = vllm_cli(
            "bench", "serve", "--backend", backend, "--base-url", self.url,
            "--endpoint", endpoint, "--model", self.model, "--tokenizer", self.tokenizer,
            "--dataset-name", "random", "--random-input-len", str(self.input_len),
            "--random-output-len", str(self.output_len), "--ignore-eos",
            "--max-concurrency", str(self.concurrency), "--num-prompts", str(self.num_prompts),
            "--num-warmups", str(warmups), "--seed", str(self.seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(result.parent), "--result-filename", result.name,
        )  # fmt: skip
        return [*cmd, "--insecure"] if self.url.startswith("https:") else cmd


Layers = Callable[[], dict[str, list[int]]]


def run(bench: BenchServe, result: Path, layers: Layers) -> dict[str, Any]:
    """Run the client (its output in RESULT-client.log), and return its figures, the CPU
    seconds of each layer of the server over the measured window, the window's wall time,
    the client's CPU and the rest of the machine's (cores)."""
    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    env = child_env()
    env.pop("OPENAI_API_KEY", None)
    if bench.key:  # vllm bench serve sends it as `Authorization: Bearer`
        env["OPENAI_API_KEY"] = bench.key
    window = _client_window(bench, result, layers, env)
    data = json.loads(result.read_text())
    return figures(data, bench.output_len) | window


def _client_window(
    bench: BenchServe, result: Path, layers: Layers, env: dict[str, str]
) -> dict[str, Any]:
    log = result.with_name(result.stem + "-client.log")
    before = after = None
    pids = layers()
    started = time.monotonic()
    with log.open("w") as out:
        client = subprocess.Popen(
            bench.command(result), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=env, cwd=ROOT, start_new_session=True,
        )  # fmt: skip
        try:
            assert client.stdout is not None
            for row in client.stdout:
                out.write(row)
                if START_MARK in row and before is None:
                    pids = layers()  # every engine process is up by now
                    before = _snapshot(pids, client.pid)
                elif RESULT_MARK in row and before is not None and after is None:
                    after = _snapshot(pids, client.pid)
                if time.monotonic() - started > bench.timeout:
                    raise RuntimeError(f"client run over {bench.timeout:.0f}s: {log}")
            client.wait(60)
        finally:
            if client.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(client.pid, signal.SIGKILL)
                client.wait()
    if client.returncode != 0 or before is None or after is None or not result.exists():
        raise RuntimeError(f"vllm bench serve failed (exit {client.returncode}): {log}")
    cpu = {layer: after[0][layer] - before[0][layer] for layer in before[0]}
    wall = after[3] - before[3]
    client_cpu = after[1] - before[1]
    other = (after[2] - before[2]) - sum(cpu.values()) - client_cpu
    return {
        "window_s": wall, "cpu_s": cpu, "cpu_s_client": client_cpu,
        "cpu_cores_other": max(0.0, other) / wall if wall else None, "client_log": str(log),
    }  # fmt: skip


def _snapshot(
    pids: dict[str, list[int]], client: int
) -> tuple[dict[str, float], float, float, float]:
    cpu = {layer: cpu_seconds(ps) for layer, ps in pids.items()}
    return cpu, process_cpu_s(client), machine_busy_s(), time.perf_counter()


def figures(data: dict[str, Any], output_len: int) -> dict[str, Any]:
    """Output tok/s (requests x --output-len: --ignore-eos makes each exactly that long),
    TTFT, TPOT and E2E percentiles of the successful requests, ITL as vLLM reports it."""
    tokens = data["completed"] * output_len
    return {
        "completed": data["completed"],
        "failed": data["failed"],
        "duration_s": data["duration"],
        "output_tokens": tokens,
        "output_tok_s": tokens / data["duration"] if data["duration"] else None,
        "request_s": data["request_throughput"],
        **latencies(data, output_len),
        "itl_p50_ms": data.get("p50_itl_ms"),
        "itl_p99_ms": data.get("p99_itl_ms"),
        "errors": [e for e in data.get("errors", []) if e][:3],
        "client": {k: v for k, v in data.items() if not isinstance(v, list)},
    }


def latencies(data: dict[str, Any], output_len: int) -> dict[str, float | None]:
    """TTFT, TPOT ((E2E - TTFT) / (output_len - 1)) and E2E p50/p90/p99 in ms."""
    import numpy as np

    ok = [i for i, e in enumerate(data["errors"]) if not e]
    ttft = [data["ttfts"][i] for i in ok]
    e2el = [data["latencies"][i] for i in ok]
    tpot = [(e - t) / max(1, output_len - 1) for t, e in zip(ttft, e2el, strict=True)]
    out: dict[str, float | None] = {}
    for metric, values in (("ttft", ttft), ("tpot", tpot), ("e2el", e2el)):
        for p in (50, 90, 99):
            out[f"{metric}_p{p}_ms"] = float(np.percentile(values, p)) * 1000 if values else None
    return out
