"""CPU cost of compressing one whole JSON answer, per coding and level, and what it saves.

Picks response_encoding.py's default levels: the answers are a chat completion, a Responses
object with a tool call and a long model list (1 KiB to ~64 KiB), compressed once each per
request. Prints a table and writes benchmarks/response_compression.json.

    .venv/bin/python benchmarks/response_compression.py
"""

from __future__ import annotations

import json
import random
import string
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import brotli
import orjson
import zstandard

# Seeded random words: text that repeats a sentence would flatter every coding.
_RANDOM = random.Random(7)
WORDS = [
    "".join(_RANDOM.choices(string.ascii_lowercase, k=_RANDOM.randint(2, 9))) for _ in range(400)
]


def _text(n_words: int) -> str:
    return " ".join(_RANDOM.choice(WORDS) for _ in range(n_words))


def answers() -> dict[str, bytes]:
    chat = {
        "id": "chatcmpl-123",
        "object": "chat.completion",
        "model": "tiny-llama",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": _text(200)}}],
        "usage": {"prompt_tokens": 20, "completion_tokens": 200, "total_tokens": 220},
    }
    response = {
        "id": "resp_1",
        "object": "response",
        "output": [
            {"type": "message", "content": [{"type": "output_text", "text": _text(1500)}]},
            {"type": "function_call", "name": "read", "arguments": json.dumps({"p": "a/b"})},
        ],
    }
    models = {
        "object": "list",
        "data": [{"id": f"org/model-{i}", "owned_by": "x"} for i in range(800)],
    }
    return {
        name: orjson.dumps(body)
        for name, body in [("chat", chat), ("response", response), ("models", models)]
    }


def codecs() -> dict[str, Callable[[bytes], bytes]]:
    found: dict[str, Callable[[bytes], bytes]] = {}
    for level in (1, 4, 6, 9):
        found[f"gzip-{level}"] = lambda d, lv=level: zlib.compress(d, lv, wbits=31)
    for quality in (1, 3, 5, 11):
        found[f"br-{quality}"] = lambda d, q=quality: brotli.compress(d, quality=q)
    for level in (1, 3, 9):
        found[f"zstd-{level}"] = zstandard.ZstdCompressor(level=level).compress
    return found


def measure(codec: Callable[[bytes], bytes], data: bytes, rounds: int = 5) -> float:
    """Microseconds per call: the best of `rounds` rounds of 20 ms (the CPUs are shared)."""
    best = float("inf")
    for _ in range(rounds):
        calls, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < 0.02:
            codec(data)
            calls += 1
        best = min(best, elapsed / calls * 1e6)
    return best


def main() -> None:
    rows = []
    for name, data in answers().items():
        for codec_name, codec in codecs().items():
            size = len(codec(data))
            rows.append(
                {
                    "answer": name,
                    "bytes": len(data),
                    "codec": codec_name,
                    "compressed": size,
                    "ratio": round(len(data) / size, 2),
                    "us": round(measure(codec, data), 1),
                }
            )
    print(f"{'answer':<9}{'bytes':>7} {'codec':<8}{'out':>7}{'ratio':>7}{'us':>9}")
    for r in rows:
        line = f"{r['answer']:<9}{r['bytes']:>7} {r['codec']:<8}{r['compressed']:>7}"
        print(f"{line}{r['ratio']:>7}{r['us']:>9}")
    out = Path(__file__).with_suffix(".json")
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
