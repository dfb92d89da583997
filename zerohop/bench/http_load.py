"""`zerohop bench` over HTTP: the load client of the OpenAI and Anthropic endpoints.

It makes a run's request bodies (fitting text prompts to `input_tokens` with the server's
token counts) and sends one request, reading its stream with `token_events`.
"""

from __future__ import annotations

import itertools
import random
import time
from typing import TYPE_CHECKING

import orjson

from zerohop.bench import ENDPOINTS
from zerohop.bench.load_types import BenchConfig, Request, RequestResult, StreamTimes
from zerohop.bench.prompts import (
    chat_body,
    completions_body,
    make_prompts,
    messages_body,
    output_lengths,
    random_words,
    spread,
)
from zerohop.bench.token_events import read_anthropic, read_openai
from zerohop.bench.workloads import Sample, cycle, sharegpt

if TYPE_CHECKING:  # aiohttp is imported only when a benchmark runs
    from aiohttp import ClientSession

ANTHROPIC_VERSION = "2023-06-01"


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
            self.path, self.reader = "/v1/messages", read_anthropic
        elif cfg.endpoint == "openai-completions":
            self.path, self.reader = "/v1/completions", read_openai
        elif cfg.endpoint == "openai-chat":
            self.path, self.reader = "/v1/chat/completions", read_openai
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
            return str((await resp.json(loads=orjson.loads))["data"][0]["id"])

    async def requests(self, n: int, salt: str) -> list[Request]:
        model = await self.model_name()
        if self.cfg.dataset:
            return self._dataset_requests(model, n, salt)
        outputs = output_lengths(self.cfg, n, salt)
        if self.cfg.endpoint == "openai-completions":
            prompts = make_prompts(self.cfg, n, salt)
            return [
                Request(completions_body(self.cfg, model, p, out), len(p))
                for p, out in zip(prompts, outputs, strict=True)
            ]
        texts = await self._anthropic_texts(model, n, salt)
        make = messages_body if self.cfg.endpoint == "anthropic-messages" else chat_body
        return [
            Request(make(self.cfg, model, t, out), self.cfg.input_tokens)
            for t, out in zip(texts, outputs, strict=True)
        ]

    def _dataset_requests(self, model: str, n: int, salt: str) -> list[Request]:
        """The next `n` conversations of the file (warm-up ones from its end)."""
        if self._samples is None:
            assert self.cfg.dataset is not None  # asked for samples of a dataset
            self._samples = sharegpt(self.cfg.dataset, self.cfg.seed)
        start = -n if salt == "warmup" else self._taken
        if salt != "warmup":
            self._taken += n
        make = {"openai-completions": completions_body, "openai-chat": chat_body}.get(
            self.cfg.endpoint, messages_body
        )
        samples = itertools.islice(cycle(self._samples, start), n)
        return [Request(make(self.cfg, model, s.prompt, s.output_tokens), 0) for s in samples]

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
                counted = (await r.json(loads=orjson.loads)).get("input_tokens")
                return counted if isinstance(counted, int) else None
        url = self.base + self.path
        one = orjson.dumps(body | {"max_tokens": 1, "stream": False})
        async with self.session.post(url, data=one, headers=self.headers) as r:
            if r.status != 200:
                return None
            usage = orjson.loads(await r.read()).get("usage") or {}
        return usage.get("prompt_tokens") or usage.get("input_tokens")

    async def send(self, request: Request, bench_start: float) -> RequestResult:
        import aiohttp

        s = StreamTimes(time.perf_counter())
        try:
            async with self.session.post(
                self.base + self.path, data=request.body, headers=self.headers
            ) as resp:
                if resp.status != 200:
                    text = (await resp.read()).decode(errors="replace")
                    s.error = f"HTTP {resp.status}: {text[:300]}"
                else:
                    await self.reader(resp.content.iter_any(), s)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            s.error = f"{type(exc).__name__}: {exc}"
        return s.result(bench_start)


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url
