"""What zerohop.client costs its caller: the same requests sent straight with httpx2 and
through `zerohop.client.http_client` (affinity, failover bookkeeping, and for streams the
per-event parse that follows token ids), side by side in one run.

One `zerohop serve` of the tiny test model (fast, so the client's own time is what differs),
`--num-threads 1`. For each way, sequentially: `--requests` non-streaming chat completions of
one token, then `--streams` streamed ones of `--tokens` tokens. Reported per request: wall
time (p50) and the caller process's CPU time (all threads: the sync transport works on the
pool's thread), and their difference through the client.

    .venv/bin/python benchmarks/client_overhead.py [--requests 300] [--streams 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import print_table, write_json
from tests.fixtures.tiny_models import build_tiny_model
from tests.live_server import LiveServer
from zerohop.client import http_client

MODEL = "tiny"


def chat(client: httpx2.Client, base: str, stream: bool, tokens: int) -> int:
    body = {
        "model": MODEL,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "messages": [{"role": "user", "content": "How far is the horizon at sea?"}],
    }
    if not stream:
        response = client.post(base + "/v1/chat/completions", json=body)
        response.raise_for_status()
        return 1
    events = 0
    with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            events += line.startswith("data: ")
    return events


def measure(send: Callable[[], int], count: int) -> dict:
    walls: list[float] = []
    cpu, events = time.process_time(), 0
    for _ in range(count):
        start = time.perf_counter()
        events += send()
        walls.append(time.perf_counter() - start)
    cpu = time.process_time() - cpu
    return {
        "wall_p50_ms": statistics.median(walls) * 1000,
        "cpu_ms_per_request": cpu / count * 1000,
        "events_per_request": events / count,
    }


def run(url: str, args: argparse.Namespace) -> dict:
    ways = {
        "httpx2 direct": (httpx2.Client(timeout=60), url),
        "zerohop.client": (http_client([url]), "http://zerohop"),
    }
    results = {}
    for name, (client, base) in ways.items():
        with client:
            results[name] = measure_client(client, base, args)
    return results


def measure_client(client: httpx2.Client, base: str, args: argparse.Namespace) -> dict:
    chat(client, base, False, 1)  # connect and warm up
    return {
        "one token": measure(lambda: chat(client, base, False, 1), args.requests),
        f"stream of {args.tokens}": measure(
            lambda: chat(client, base, True, args.tokens), args.streams
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--streams", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench-results/client_overhead.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        build_tiny_model(model, "llama")
        server = LiveServer(model, ["--no-gateway", "--grpc-port", "0"], served_model_name=MODEL)
        (Path(tmp) / "log").mkdir()
        server.start(Path(tmp) / "log" / "server.log")
        try:
            results = run(server.url, args)
        finally:
            server.stop()
    rows = []
    for kind in results["httpx2 direct"]:
        direct, client = results["httpx2 direct"][kind], results["zerohop.client"][kind]
        rows.append(
            [kind, f"{direct['wall_p50_ms']:.2f}", f"{client['wall_p50_ms']:.2f}",
             f"{direct['cpu_ms_per_request']:.2f}", f"{client['cpu_ms_per_request']:.2f}",
             f"{client['cpu_ms_per_request'] - direct['cpu_ms_per_request']:+.2f}"]
        )  # fmt: skip
    headers = ["request", "wall p50 direct", "via client", "CPU ms direct", "via client", "added"]
    print_table(headers, rows)
    write_json(args.out, {"args": vars(args) | {"out": str(args.out)}, "results": results})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
