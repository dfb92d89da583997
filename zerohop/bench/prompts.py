"""What a `zerohop bench` run sends: prompts (random token ids with shared prefixes, or
random words for the text endpoints), their lengths, and the streaming request bodies."""

from __future__ import annotations

import random
import string
from typing import Any

import orjson

from zerohop.bench.load_types import BenchConfig

FIRST_ID = 4  # random prompt ids skip the special ids 0-3 of the toy tokenizers


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
