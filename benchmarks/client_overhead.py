"""What zerohop.client costs its caller: the same requests sent straight with httpx2 and
through `zerohop.client.http_client` (affinity, failover bookkeeping, and for streams the
per-event parse that follows token ids), side by side in one run.

One `zerohop serve` of the tiny test model (fast, so the client's own time is what differs),
`--num-threads 1`. Sync (`httpx2.Client`, `http_client`) and async (`httpx2.AsyncClient`,
`async_http_client`); for each way, sequentially: `--requests` non-streaming chat completions of
one token, then `--streams` streamed ones of `--tokens` tokens. Reported per request: wall
time (p50) and the caller process's CPU time (all threads: the sync transport works on the
pool's thread), and their difference through the client.

    .venv/bin/python benchmarks/client_overhead.py [--requests 300] [--streams 30]
"""

from __future__ import annotations

import argparse
import asyncio
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
from zerohop import sse
from zerohop.client import async_http_client, http_client

MODEL = "tiny"


def request_body(stream: bool, tokens: int) -> dict:
    return {
        "model": MODEL,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "messages": [{"role": "user", "content": "How far is the horizon at sea?"}],
    }


def chat(client: httpx2.Client, base: str, stream: bool, tokens: int) -> int:
    body = request_body(stream, tokens)
    if not stream:
        response = client.post(base + "/v1/chat/completions", json=body)
        response.raise_for_status()
        return 1
    events = 0
    with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        events += sum(e.data is not None for e in sse.events(response.iter_bytes()))
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


async def achat(client: httpx2.AsyncClient, base: str, stream: bool, tokens: int) -> int:
    body = request_body(stream, tokens)
    if not stream:
        response = await client.post(base + "/v1/chat/completions", json=body)
        response.raise_for_status()
        return 1
    events = 0
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for event in sse.aevents(response.aiter_bytes()):
            events += event.data is not None
    return events


def run(url: str, args: argparse.Namespace) -> dict:
    results = {}
    for name, client, base in (
        ("sync, httpx2 direct", httpx2.Client(timeout=60), url),
        ("sync, zerohop.client", http_client([url]), "http://zerohop"),
    ):
        with client:
            results[name] = measure_client(lambda s, t, c=client, b=base: chat(c, b, s, t), args)
    loop = asyncio.new_event_loop()
    for name, make, base in (
        ("async, httpx2 direct", lambda: httpx2.AsyncClient(timeout=60), url),
        ("async, zerohop.client", lambda: async_http_client([url]), "http://zerohop"),
    ):
        client = loop.run_until_complete(_made(make))

        def send(stream: bool, tokens: int, c=client, b=base) -> int:
            return loop.run_until_complete(achat(c, b, stream, tokens))

        results[name] = measure_client(send, args)
        loop.run_until_complete(client.aclose())
    loop.close()
    return results


async def _made(make: Callable[[], httpx2.AsyncClient]) -> httpx2.AsyncClient:
    return make()  # in the loop that will use it


def measure_client(send: Callable[[bool, int], int], args: argparse.Namespace) -> dict:
    send(False, 1)  # connect and warm up
    return {
        "one token": measure(lambda: send(False, 1), args.requests),
        f"stream of {args.tokens}": measure(lambda: send(True, args.tokens), args.streams),
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
    for mode in ("sync", "async"):
        direct, client = results[f"{mode}, httpx2 direct"], results[f"{mode}, zerohop.client"]
        for kind in direct:
            d, c = direct[kind], client[kind]
            rows.append(
                [f"{mode}, {kind}", f"{d['wall_p50_ms']:.2f}", f"{c['wall_p50_ms']:.2f}",
                 f"{d['cpu_ms_per_request']:.2f}", f"{c['cpu_ms_per_request']:.2f}",
                 f"{c['cpu_ms_per_request'] - d['cpu_ms_per_request']:+.2f}"]
            )  # fmt: skip
    headers = ["request", "wall p50 direct", "via client", "CPU ms direct", "via client", "added"]
    print_table(headers, rows)
    write_json(args.out, {"args": vars(args) | {"out": str(args.out)}, "results": results})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
