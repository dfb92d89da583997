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

Per event the client only finds `data:` lines and looks for a few byte patterns; JSON is
parsed (orjson) only for the usage and error chunks, so the client stays cheaper than the
server it measures.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import string
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from zerohop.bench import ENDPOINTS
from zerohop.bench.arrivals import send_times
from zerohop.bench.metrics import distribution_ms, format_report, summarize
from zerohop.bench.workloads import Sample, cycle, sharegpt

__all__ = ["BenchConfig", "RequestResult", "distribution_ms", "format_report", "run_benchmark",
           "summarize"]  # fmt: skip

if TYPE_CHECKING:  # aiohttp is imported only when a benchmark runs
    from aiohttp import ClientSession, StreamReader

FIRST_ID = 4  # random prompt ids skip the special ids 0-3 of the toy tokenizers
ANTHROPIC_VERSION = "2023-06-01"


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
class _Request:
    body: bytes
    prompt_tokens: int  # what the client asked for (anthropic: approximate)


# -- prompts --------------------------------------------------------------------------------


def make_prompts(cfg: BenchConfig, n: int, salt: str = "") -> list[list[int]]:
    """The completions prompts of a run: `cfg.prompt_source`'s, or random ids."""
    return (cfg.prompt_source or random_prompts)(cfg, n, salt)


def random_prompts(cfg: BenchConfig, n: int, salt: str = "") -> list[list[int]]:
    """`n` prompts of exactly `input_tokens` ids; each starts with the `shared_prefix_tokens`
    of one of `prefix_groups` prefixes (the same prefixes whatever the salt)."""
    if cfg.vocab_size <= FIRST_ID:
        raise ValueError(f"vocab_size must be above {FIRST_ID}")
    shared = min(cfg.shared_prefix_tokens, cfg.input_tokens)
    prefixes = [
        _ids(random.Random(f"{cfg.seed}-prefix-{g}"), cfg, shared)
        for g in range(max(1, cfg.prefix_groups))
    ]
    rng = random.Random(f"{cfg.seed}-{salt}")
    lengths = spread(cfg.input_tokens, cfg.range_ratio, n, f"{cfg.seed}-{salt}-in")
    return [rng.choice(prefixes) + _ids(rng, cfg, max(0, k - shared)) for k in lengths]


def spread(length: int, ratio: float, n: int, seed: str) -> list[int]:
    """`n` lengths uniform in [length (1 - ratio), length (1 + ratio)], at least 1."""
    if not 0 <= ratio < 1:
        raise ValueError("range_ratio must be in [0, 1)")
    rng = random.Random(seed)
    low, high = max(1, round(length * (1 - ratio))), max(1, round(length * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def output_lengths(cfg: BenchConfig, n: int, salt: str) -> list[int]:
    return spread(cfg.output_tokens, cfg.range_ratio, n, f"{cfg.seed}-{salt}-out")


def _ids(rng: random.Random, cfg: BenchConfig, n: int) -> list[int]:
    return [rng.randrange(FIRST_ID, cfg.vocab_size) for _ in range(n)]


def random_words(rng: random.Random, n: int) -> list[str]:
    letters = string.ascii_lowercase
    return ["".join(rng.choices(letters, k=rng.randint(2, 6))) for _ in range(n)]


def completions_body(
    cfg: BenchConfig, model: str, prompt: list[int] | str, max_tokens: int | None = None
) -> bytes:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens or cfg.output_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.logprobs is not None:
        body["logprobs"] = cfg.logprobs
    return orjson.dumps(body)


def messages_body(cfg: BenchConfig, model: str, text: str, max_tokens: int | None = None) -> bytes:
    return orjson.dumps(
        {
            "model": model,
            "max_tokens": max_tokens or cfg.output_tokens,
            "temperature": cfg.temperature,
            "stream": True,
            "messages": [{"role": "user", "content": text}],
        }
    )


def chat_body(cfg: BenchConfig, model: str, text: str, max_tokens: int | None = None) -> bytes:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens or cfg.output_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": text}],
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return orjson.dumps(body)


# -- SSE streams ------------------------------------------------------------------------------


class _Stream:
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


def _data(line: bytes) -> bytes | None:
    if not line.startswith(b"data:"):
        return None
    return line[5:].strip()


async def _read_openai(content: StreamReader, s: _Stream) -> None:
    async for line in content:
        payload = _data(line)
        if payload is None or not payload:
            continue
        if payload == b"[DONE]":
            return
        # Compact JSON (orjson, pydantic) lets a token chunk be told apart without parsing;
        # escaped text can never contain these patterns.
        if b'"role":"assistant","content":""' in payload:
            continue  # a chat stream's opening chunk: no token
        if b'"choices":[{' in payload and b'"finish_reason":null' in payload:
            s.token_event()
            if b'"usage":{' in payload:
                _openai_usage(s, orjson.loads(payload))
        elif b'"usage":{' in payload and b'"choices":[]' in payload:
            _openai_usage(s, orjson.loads(payload))
        else:
            _openai_other(s, orjson.loads(payload))


def _openai_usage(s: _Stream, data: dict) -> None:
    usage = data.get("usage") or {}
    s.prompt_tokens = usage.get("prompt_tokens") or 0
    s.output_tokens = usage.get("completion_tokens") or 0


def _openai_other(s: _Stream, data: dict) -> None:
    if choices := data.get("choices"):
        choice = choices[0]
        # A chunk without text that finishes the stream or carries the usage (zerohop sends
        # the finish right after the last token's chunk; LiteLLM sends the usage in a choice
        # without a finish_reason) is not a token; it stands for one only if none came.
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        marker = (choice.get("finish_reason") or data.get("usage")) and not text
        if not marker or not s.events:
            s.token_event()
    if data.get("usage"):
        _openai_usage(s, data)
    if error := data.get("error"):
        s.error = f"stream error: {error.get('message', error)}"


async def _read_anthropic(content: StreamReader, s: _Stream) -> None:
    event = b""
    async for line in content:
        if line.startswith(b"event:"):
            event = line[6:].strip()
            continue
        payload = _data(line)
        if not payload:
            continue
        if event == b"content_block_delta":
            s.token_event()
        elif event == b"message_start":
            usage = orjson.loads(payload)["message"].get("usage") or {}
            s.prompt_tokens = sum(
                usage.get(k) or 0
                for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
            )
        elif event == b"message_delta":
            s.output_tokens = (orjson.loads(payload).get("usage") or {}).get("output_tokens") or 0
        elif event == b"error":
            error = orjson.loads(payload).get("error") or {}
            s.error = f"stream error: {error.get('message', error)}"
        elif event == b"message_stop":
            return


# -- the client -------------------------------------------------------------------------------


class LoadClient:
    def __init__(self, cfg: BenchConfig, session: ClientSession) -> None:
        self.cfg = cfg
        self.session = session
        self.base = base_url(cfg.url)
        self.headers = {"content-type": "application/json"}
        if cfg.api_key:
            self.headers["authorization"] = f"Bearer {cfg.api_key}"
            self.headers["x-api-key"] = cfg.api_key
        if cfg.endpoint == "anthropic-messages":
            self.headers["anthropic-version"] = ANTHROPIC_VERSION
            self.path, self.reader = "/v1/messages", _read_anthropic
        elif cfg.endpoint == "openai-completions":
            self.path, self.reader = "/v1/completions", _read_openai
        elif cfg.endpoint == "openai-chat":
            self.path, self.reader = "/v1/chat/completions", _read_openai
        else:
            raise ValueError(f"unknown endpoint {cfg.endpoint!r}; one of {ENDPOINTS}")
        self._samples: list[Sample] | None = None  # --dataset's conversations
        self._taken = 0

    async def model_name(self) -> str:
        if self.cfg.model:
            return self.cfg.model
        async with self.session.get(self.base + "/v1/models", headers=self.headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"GET /v1/models: HTTP {resp.status}; pass --model")
            return (await resp.json(loads=orjson.loads))["data"][0]["id"]

    async def requests(self, n: int, salt: str) -> list[_Request]:
        model = await self.model_name()
        if self.cfg.dataset:
            return self._dataset_requests(model, n, salt)
        outputs = output_lengths(self.cfg, n, salt)
        if self.cfg.endpoint == "openai-completions":
            prompts = make_prompts(self.cfg, n, salt)
            return [
                _Request(completions_body(self.cfg, model, p, out), len(p))
                for p, out in zip(prompts, outputs, strict=True)
            ]
        texts = await self._anthropic_texts(model, n, salt)
        make = messages_body if self.cfg.endpoint == "anthropic-messages" else chat_body
        return [
            _Request(make(self.cfg, model, t, out), self.cfg.input_tokens)
            for t, out in zip(texts, outputs, strict=True)
        ]

    def _dataset_requests(self, model: str, n: int, salt: str) -> list[_Request]:
        """The next `n` conversations of the file (warm-up ones from its end)."""
        if self._samples is None:
            self._samples = sharegpt(self.cfg.dataset, self.cfg.seed)
        start = -n if salt == "warmup" else self._taken
        if salt != "warmup":
            self._taken += n
        make = {"openai-completions": completions_body, "openai-chat": chat_body}.get(
            self.cfg.endpoint, messages_body
        )
        samples = itertools.islice(cycle(self._samples, start), n)
        return [_Request(make(self.cfg, model, s.prompt, s.output_tokens), 0) for s in samples]

    async def _anthropic_texts(self, model: str, n: int, salt: str) -> list[str]:
        """Texts of about `input_tokens` tokens once templated: the number of words is fitted
        with count_tokens on a sample (1 token per word if the server lacks the endpoint)."""
        words = await self._fit_words(model)
        cfg = self.cfg
        shared = round(words * min(1.0, cfg.shared_prefix_tokens / cfg.input_tokens))
        prefixes = [
            random_words(random.Random(f"{cfg.seed}-prefix-{g}"), shared)
            for g in range(max(1, cfg.prefix_groups))
        ]
        rng = random.Random(f"{cfg.seed}-{salt}")
        scale = words / cfg.input_tokens  # words per token, as fitted
        lengths = spread(cfg.input_tokens, cfg.range_ratio, n, f"{cfg.seed}-{salt}-in")
        return [
            " ".join(rng.choice(prefixes) + random_words(rng, max(0, round(k * scale) - shared)))
            for k in lengths
        ]

    async def _fit_words(self, model: str, tries: int = 4) -> int:
        target = self.cfg.input_tokens
        sample = random_words(random.Random(f"{self.cfg.seed}-calibrate"), 4 * target + 100)
        words, per_word = target, 1.0
        small, large = await self._count(model, sample[:10]), await self._count(model, sample)
        if small is None or large is None or large <= small:
            return words
        per_word = (large - small) / (len(sample) - 10)
        words = max(1, round(10 + (target - small) / per_word))
        for _ in range(tries):  # the fit is rough for short prompts: correct on the real count
            count = await self._count(model, sample[:words])
            step = round((target - (count or target)) / per_word)
            if not step:
                break
            words = max(1, min(len(sample), words + step))
        return words

    async def _count(self, model: str, words: list[str]) -> int | None:
        """The prompt's tokens once templated: zerohop's (and Anthropic's) count_tokens, else
        the usage of a one-token request (servers and proxies without count_tokens)."""
        body = {"model": model, "messages": [{"role": "user", "content": " ".join(words)}]}
        url = self.base + "/v1/messages/count_tokens"
        async with self.session.post(url, data=orjson.dumps(body), headers=self.headers) as r:
            if r.status == 200:
                return (await r.json(loads=orjson.loads)).get("input_tokens")
        url = self.base + self.path
        one = orjson.dumps(body | {"max_tokens": 1, "stream": False})
        async with self.session.post(url, data=one, headers=self.headers) as r:
            if r.status != 200:
                return None
            usage = orjson.loads(await r.read()).get("usage") or {}
        return usage.get("prompt_tokens") or usage.get("input_tokens")

    async def send(self, request: _Request, bench_start: float) -> RequestResult:
        import aiohttp

        start = time.perf_counter()
        s = _Stream(start)
        result = RequestResult(sent_at=start - bench_start)
        try:
            async with self.session.post(
                self.base + self.path, data=request.body, headers=self.headers
            ) as resp:
                if resp.status != 200:
                    text = (await resp.read()).decode(errors="replace")
                    s.error = f"HTTP {resp.status}: {text[:300]}"
                else:
                    await self.reader(resp.content, s)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            s.error = f"{type(exc).__name__}: {exc}"
        if s.error is None and not s.events:
            s.error = "no token events in the response"
        result.ok = s.error is None
        result.error = s.error
        result.events, result.ttft, result.itl = s.events, s.ttft, s.itl
        result.e2e = s.last - start
        result.prompt_tokens = s.prompt_tokens
        result.output_tokens = s.output_tokens or s.events
        return result


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class _Feed:
    """The run's requests, made in chunks as they are needed (a timed run has no count)."""

    CHUNK = 256

    def __init__(self, client: LoadClient, limit: int) -> None:
        self.client, self.limit = client, limit
        self.made: list[_Request] = []
        self.chunks = 0

    async def get(self, i: int) -> _Request | None:
        if i >= self.limit:
            return None
        while i >= len(self.made):
            size = min(self.CHUNK, self.limit - len(self.made))
            self.made += await self.client.requests(size, f"bench-{self.chunks}")
            self.chunks += 1
        return self.made[i]


async def bench(cfg: BenchConfig, on_done: Callable[[RequestResult], None] | None = None) -> dict:
    """Run the benchmark; return the report (config, summary, per-request rows).
    `on_done` is called with each finished request (a progress bar)."""
    import aiohttp

    if cfg.concurrency < 1 or cfg.num_requests < 1:
        raise ValueError("concurrency and num_requests must be at least 1")
    connector = aiohttp.TCPConnector(limit=cfg.concurrency, ttl_dns_cache=300, ssl=not cfg.insecure)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        client = _client(cfg, session)
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


def _client(cfg: BenchConfig, session: ClientSession) -> LoadClient:
    if cfg.endpoint == "grpc":
        from zerohop.bench.grpc_load import GrpcLoadClient

        return GrpcLoadClient(cfg)  # the same requests/send interface
    return LoadClient(cfg, session)


def _deadline(cfg: BenchConfig, start: float) -> float:
    return math.inf if cfg.duration_s is None else start + cfg.duration_s


OnDone = Callable[[RequestResult], None]


async def _closed_loop(
    cfg: BenchConfig, client: LoadClient, feed: _Feed, start: float, on_done: OnDone
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
    cfg: BenchConfig, client: LoadClient, feed: _Feed, start: float, on_done: OnDone
) -> list[RequestResult]:
    results: list[RequestResult] = []
    slots = asyncio.Semaphore(cfg.concurrency)
    deadline = _deadline(cfg, start)

    async def one(request: _Request) -> None:
        async with slots:
            results.append(result := await client.send(request, start))
        on_done(result)

    tasks = []
    times = send_times(cfg.request_rate, cfg.burstiness, cfg.seed)
    for i, at in enumerate(times):
        if start + at >= deadline or (request := await feed.get(i)) is None:
            break
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tasks.append(asyncio.create_task(one(request)))
    await asyncio.gather(*tasks)
    return results


def run_benchmark(cfg: BenchConfig, on_done: Callable[[RequestResult], None] | None = None) -> dict:
    """`bench` on a fresh event loop (uvloop when installed)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(bench(cfg, on_done))
    return uvloop.run(bench(cfg, on_done))


def _row(r: RequestResult) -> dict:
    row = asdict(r)
    row["itl"] = [round(x, 6) for x in r.itl]
    return row
