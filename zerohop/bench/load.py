"""A streaming load client with vLLM's serving metrics (`vllm bench serve`).

Closed loop (no `request_rate`): `concurrency` workers each send one request at a time.
Open loop: requests go out at `request_rate` per second with gamma-distributed gaps
(`burstiness`, see `arrivals`), at most `concurrency` in flight. Either way the run ends after
`num_requests` requests or `duration_s` seconds, whichever comes first. Per request (times
from sending the request):
  TTFT  arrival of the first token event (a chunk with choices / a `content_block_delta`);
  E2E   arrival of the last token event;
  ITL   every gap between consecutive token events of the request;
  TPOT  (E2E - TTFT) / (output_tokens - 1), for requests with more than one output token.
A chunk that carries only a finish reason is not a token event (unless no token had one).
Servers that send no chunk for tokens without visible text make fewer events than tokens: the
report's check `one_event_per_token` says so, and TTFT/ITL then describe text events.
Output tokens come from the usage the server reports (`stream_options.include_usage`, or
Anthropic's `message_delta`), else from the number of token events. Throughputs divide by the
benchmark's duration (first request sent to last request done, warm-up excluded).

This module is the run loop; the HTTP client is `http_load` (prompts and bodies: `prompts`,
reading a stream: `token_events`), the gRPC one `grpc_load`, the shared types `load_types`.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from zerohop.bench.arrivals import send_times
from zerohop.bench.http_load import LoadClient
from zerohop.bench.load_types import BenchConfig, Request, RequestResult, Sender
from zerohop.bench.metrics import summarize

__all__ = ["bench", "run_benchmark"]

if TYPE_CHECKING:  # aiohttp is imported only when a benchmark runs
    from aiohttp import ClientSession

OnDone = Callable[[RequestResult], None]
ClientClass = Callable[[BenchConfig, "ClientSession"], LoadClient]


class _Feed:
    """The run's requests, made in chunks as they are needed (a timed run has no count)."""

    CHUNK = 256

    def __init__(self, client: Sender, limit: int) -> None:
        self.client, self.limit = client, limit
        self.made: list[Request] = []
        self.chunks = 0

    async def get(self, i: int) -> Request | None:
        if i >= self.limit:
            return None
        while i >= len(self.made):
            size = min(self.CHUNK, self.limit - len(self.made))
            self.made += await self.client.requests(size, f"bench-{self.chunks}")
            self.chunks += 1
        return self.made[i]


async def bench(
    cfg: BenchConfig, on_done: OnDone | None = None, client_class: ClientClass = LoadClient
) -> dict[str, Any]:
    """Run the benchmark; return the report (config, summary, per-request rows).
    `on_done` is called with each finished request (a progress bar); `client_class` makes
    the HTTP endpoints' client (a `LoadClient` subclass that changes a step of it)."""
    import aiohttp

    if cfg.concurrency < 1 or cfg.num_requests < 1:
        raise ValueError("concurrency and num_requests must be at least 1")
    connector = aiohttp.TCPConnector(limit=cfg.concurrency, ttl_dns_cache=300, ssl=not cfg.insecure)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        client = _client(cfg, session, client_class)
        for request in await client.requests(cfg.warmup_requests, "warmup"):
            done = await client.send(request, time.perf_counter())
            if not done.ok:
                raise RuntimeError(f"warm-up request failed: {done.error}")
        feed = _Feed(client, cfg.num_requests)
        await feed.get(0)  # the first chunk is made before the clock starts
        cpu, start = time.process_time(), time.perf_counter()
        run = _open_loop if cfg.request_rate is not None else _closed_loop
        results = await run(cfg, client, feed, start, on_done or (lambda _: None))
        duration = time.perf_counter() - start
        cpu = time.process_time() - cpu
        if hasattr(client, "close"):
            await client.close()
    return {
        "config": asdict(cfg)
        | {"api_key": None, "prompt_source": getattr(cfg.prompt_source, "__doc__", None)},
        "summary": summarize(results, duration, cfg, cpu),
        "requests": [_row(r) for r in results],
    }


def _client(cfg: BenchConfig, session: ClientSession, client_class: ClientClass) -> Sender:
    if cfg.endpoint == "grpc":
        from zerohop.bench.grpc_load import GrpcLoadClient

        return GrpcLoadClient(cfg)  # the same requests/send interface
    return client_class(cfg, session)


def _deadline(cfg: BenchConfig, start: float) -> float:
    return math.inf if cfg.duration_s is None else start + cfg.duration_s


async def _closed_loop(
    cfg: BenchConfig, client: Sender, feed: _Feed, start: float, on_done: OnDone
) -> list[RequestResult]:
    results: list[RequestResult] = []
    deadline, counter = _deadline(cfg, start), itertools.count()

    async def worker() -> None:
        while time.perf_counter() < deadline and (request := await feed.get(next(counter))):
            results.append(result := await client.send(request, start))
            on_done(result)

    await asyncio.gather(*(worker() for _ in range(min(cfg.concurrency, cfg.num_requests))))
    return results


async def _open_loop(
    cfg: BenchConfig, client: Sender, feed: _Feed, start: float, on_done: OnDone
) -> list[RequestResult]:
    results: list[RequestResult] = []
    slots = asyncio.Semaphore(cfg.concurrency)
    deadline = _deadline(cfg, start)

    async def one(request: Request) -> None:
        async with slots:
            results.append(result := await client.send(request, start))
        on_done(result)

    tasks = []
    assert cfg.request_rate is not None  # an open loop has a rate
    times = send_times(cfg.request_rate, cfg.burstiness, cfg.seed)
    for i, at in enumerate(times):
        if start + at >= deadline or (request := await feed.get(i)) is None:
            break
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tasks.append(asyncio.create_task(one(request)))
    await asyncio.gather(*tasks)
    return results


def run_benchmark(
    cfg: BenchConfig, on_done: OnDone | None = None, client_class: ClientClass = LoadClient
) -> dict[str, Any]:
    """`bench` on a fresh event loop (uvloop when installed)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(bench(cfg, on_done, client_class))
    return uvloop.run(bench(cfg, on_done, client_class))


def _row(r: RequestResult) -> dict[str, Any]:
    row = asdict(r)
    row["itl"] = [round(x, 6) for x in r.itl]
    return row
