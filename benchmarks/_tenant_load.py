"""Streaming completions for several tenants' keys through one connection pool, for
fairness.py: requests kept in flight, one-at-a-time probes, the gaps between a stream's token
chunks, and the output tokens the server counted per tenant."""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
from _common import TextPrompts

from zerohop import sse

MODEL = "default"


@dataclass
class Result:
    status: int
    ttft: float | None = None
    token_times: list[float] = field(default_factory=list)
    error: str = ""
    retry_after: float = 0.0


class Load:
    """Streaming completions through one connection pool; prompts of the model's own text."""

    def __init__(self, url: str, keys: dict[str, str], prompts: TextPrompts, args) -> None:
        self.url, self.keys, self.prompts, self.args = url, keys, prompts, args
        self.rng = random.Random(0)
        self.client: httpx.AsyncClient
        self.server: Any = None  # the ZerohopServer it drives
        self.gaps: list[float] = []  # the background streams' gaps during the last `under`
        self.all_gaps: list[float] = []  # ... over the whole of it

    def run(self, method, *args):
        """`method(*args)` in a fresh event loop with its own connection pool."""

        async def go():
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
            async with httpx.AsyncClient(base_url=self.url, timeout=600, limits=limits) as c:
                self.client = c
                return await method(*args)

        return asyncio.run(go())

    async def request(self, key: str, max_tokens: int, sink: list[Result] | None = None) -> Result:
        """One streamed completion; `sink` gets its Result at once, so a request cancelled
        mid-stream still shows the tokens it had."""
        body = {
            "model": MODEL,
            "prompt": self.prompts.prompt(self.rng, self.args.prompt_tokens),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        headers = {"authorization": f"Bearer {self.keys[key]}"}
        start = time.monotonic()
        async with self.client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            result = Result(r.status_code)
            if sink is not None:
                sink.append(result)
            if r.status_code != 200:
                result.error = (await r.aread()).decode(errors="replace")
                result.retry_after = float(r.headers.get("retry-after", 0))
                return result
            async for event in sse.aevents(r.aiter_bytes()):
                if (event.data or b"").startswith(b"{"):
                    now = time.monotonic()
                    result.ttft = result.ttft if result.ttft is not None else now - start
                    result.token_times.append(now)
        return result

    async def keep_in_flight(
        self, key: str, count: int, stop: asyncio.Event, lengths: tuple[int, int] | None = None
    ) -> list[Result]:
        """`count` requests of `key` in flight until `stop`: each --long-tokens long, or of a
        length drawn from `lengths` (which keeps them from ending all at once)."""
        results: list[Result] = []

        def length() -> int:
            return self.args.long_tokens if lengths is None else self.rng.randint(*lengths)

        async def loop() -> None:
            while not stop.is_set():
                try:
                    await self.request(key, length(), results)
                except httpx.HTTPError as exc:
                    results.append(Result(0, error=repr(exc)))
                await asyncio.sleep(results[-1].retry_after)  # as the SDKs do on 503/529

        tasks = [asyncio.create_task(loop()) for _ in range(count)]
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return results

    async def probe(self, key: str) -> list[float]:
        ttfts = []
        for _ in range(self.args.probes):
            result = await self.request(key, self.args.probe_tokens)
            if result.status != 200 or result.ttft is None:
                raise RuntimeError(f"probe failed: {result.status} {result.error}")
            ttfts.append(result.ttft)
        return ttfts

    async def warm_up(self, key: str) -> None:
        """--warmups unmeasured requests: a new server's first steps are not its steady ones."""
        for _ in range(self.args.warmups):
            result = await self.request(key, self.args.probe_tokens)
            if result.status != 200:
                raise RuntimeError(f"warm-up failed: {result.status} {result.error}")

    async def under(self, background: dict[str, int], probe_key: str) -> list[float]:
        """Probe TTFTs while `background` keys keep their request counts in flight. The
        background streams' gaps between token chunks (as this client receives them; each
        stream's first token is its TTFT, not a gap) go to `self.gaps`, those during the
        probes, and to `self.all_gaps`, all of them."""
        stop = asyncio.Event()
        floods = [
            asyncio.create_task(self.keep_in_flight(k, n, stop)) for k, n in background.items()
        ]
        await asyncio.sleep(5.0)  # let the queue build
        start = time.monotonic()
        ttfts = await self.probe(probe_key)
        end = time.monotonic()
        stop.set()
        results = [r for flood in await asyncio.gather(*floods) for r in flood]
        pairs = [pair for r in results for pair in itertools.pairwise(r.token_times)]
        self.all_gaps = [later - earlier for earlier, later in pairs]
        self.gaps = [
            later - earlier for earlier, later in pairs if start <= earlier and later <= end
        ]
        return ttfts

    async def weighted(self) -> dict[str, float]:
        stop = asyncio.Event()
        lengths = (self.args.long_tokens // 8, self.args.long_tokens // 2)
        runs = {
            k: asyncio.create_task(self.keep_in_flight(k, 32, stop, lengths))
            for k in ("light", "heavy")
        }
        await asyncio.sleep(10.0)  # warm-up: both backlogged
        start, before = time.monotonic(), await self.served_tokens()
        await asyncio.sleep(self.args.window)
        end, after = time.monotonic(), await self.served_tokens()
        stop.set()
        tokens: dict = {}
        for key, task in runs.items():
            results = await task
            tokens[key] = sum(start <= t < end for r in results for t in r.token_times)
            tokens[f"{key}_statuses"] = dict(Counter(str(r.status) for r in results))
        # The server's count (zerohop_output_tokens_total, of requests that ended in the
        # window) is the figure: the client's own arrival times lag when it is short of CPU.
        server = {t: after.get(t, 0) - before.get(t, 0) for t in ("heavy", "light")}
        tokens["server_output_tokens"] = server
        tokens["client_ratio"] = tokens["heavy"] / max(1, tokens["light"])
        return {**tokens, "ratio": server["heavy"] / max(1, server["light"])}

    async def served_tokens(self) -> dict[str, float]:
        """zerohop_output_tokens_total by tenant, from /metrics."""
        text = (await self.client.get("/metrics")).text
        out = {}
        for line in text.splitlines():
            if line.startswith("zerohop_output_tokens_total{"):
                labels, _, value = line.rpartition(" ")
                tenant = labels.split('tenant="', 1)[1].split('"', 1)[0]
                out[tenant] = float(value)
        return out


def p50(values: list[float]) -> float:
    return statistics.median(values) * 1000


def gap_figures(gaps: list[float]) -> dict[str, float | int | None]:
    """The flood's gaps between tokens: p50, p99 and max in ms (the inter-token target is a
    step's time; a client sees a step's tokens as one gap and near-zero ones)."""
    if not gaps:
        return {"gaps": 0, "p50": None, "p99": None, "max": None}
    ordered = sorted(gaps)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"gaps": len(gaps), "p50": p50(gaps), "p99": p99 * 1000, "max": ordered[-1] * 1000}
