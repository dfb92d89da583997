"""What a `zerohop bench` run is given and what it records: the run's configuration, one
prepared request, the timestamps of one response's token events, and each request's result.

A leaf module (nothing of zerohop imported), so the load client, the gRPC client, the metrics
and the prompt makers share these types without importing each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(slots=True)
class BenchConfig:
    url: str
    concurrency: int = 1
    input_tokens: int = 128
    output_tokens: int = 64
    num_requests: int = 32
    endpoint: str = "openai-completions"
    model: str | None = None  # None: the first model of GET /v1/models
    seed: int = 0
    vocab_size: int = 512  # prompt ids are drawn from [4, vocab_size)
    shared_prefix_tokens: int = 0  # the same first tokens in every prompt (prefix cache hits)
    prefix_groups: int = 1  # shared_prefix_tokens: this many distinct prefixes, one per group
    # vLLM's --random-range-ratio: each prompt's and output's length uniform in L(1 +- r).
    range_ratio: float = 0.0
    dataset: str | None = None  # a ShareGPT-format JSON file instead of random prompts
    ignore_eos: bool = True  # send `ignore_eos` (vLLM's extra) so outputs are exactly O tokens
    temperature: float = 0.0
    # Completions `logprobs` (vllm bench's --logprobs). zerohop sends a chunk for every token
    # that carries logprobs, even one whose text is still empty.
    logprobs: int | None = None
    warmup_requests: int = 1
    api_key: str | None = None
    timeout_s: float = 600.0
    insecure: bool = False  # https without certificate checks (a self-signed proxy in front)
    # Completions prompts: (cfg, n, salt) -> n token-id lists; None: `random_prompts`.
    prompt_source: Callable[[BenchConfig, int, str], list[list[int]]] | None = None
    request_rate: float | None = None  # requests/s (open loop); None: closed loop
    burstiness: float = 1.0  # gamma shape of the gaps between sends: 1 is Poisson
    duration_s: float | None = None  # stop sending after this long (and num_requests)
    slo: dict[str, float] | None = None  # ms per metric (ttft, tpot, itl, e2el): goodput


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0  # as the server reported (0: not reported)
    output_tokens: int = 0  # as the server reported, else the number of token events
    events: int = 0  # token events received
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    sent_at: float = 0.0  # seconds after the benchmark started


@dataclass(slots=True)
class Request:
    body: Any  # bytes (HTTP) or a GenerateRequest (gRPC)
    prompt_tokens: int  # what the client asked for (anthropic: approximate)


class StreamTimes:
    """Timestamps of one response's token events, and its usage."""

    __slots__ = (
        "error",
        "events",
        "itl",
        "last",
        "output_tokens",
        "prompt_tokens",
        "start",
        "ttft",
    )

    def __init__(self, start: float) -> None:
        self.start = self.last = start
        self.ttft = 0.0
        self.events = 0
        self.itl: list[float] = []
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.error: str | None = None

    def token_event(self) -> None:
        now = time.perf_counter()
        if self.events:
            self.itl.append(now - self.last)
        else:
            self.ttft = now - self.start
        self.last = now
        self.events += 1

    def result(self, bench_start: float) -> RequestResult:
        """The request's result once its response ended (a response without token events
        failed)."""
        if self.error is None and not self.events:
            self.error = "no token events in the response"
        return RequestResult(
            ok=self.error is None,
            error=self.error,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens or self.events,
            events=self.events,
            ttft=self.ttft,
            e2e=self.last - self.start,
            itl=self.itl,
            sent_at=self.start - bench_start,
        )


class Sender(Protocol):
    """A load client, over HTTP (http_load.LoadClient) or gRPC (grpc_load.GrpcLoadClient)."""

    async def requests(self, n: int, salt: str) -> list[Request]: ...

    async def send(self, request: Request, bench_start: float) -> RequestResult: ...
