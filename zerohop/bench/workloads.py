"""Prompts from a ShareGPT-format file, as `vllm bench serve --dataset-name sharegpt` reads it.

A file is a JSON list of `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
"value": ...}, ...]}`. Each conversation gives one request: its first human turn is the
prompt, and its first reply's length sets max_tokens (about 4 characters per token: the
client has no tokenizer). Conversations without both are skipped; the order is shuffled
with the run's seed and cycled when the run needs more requests than the file has.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

CHARS_PER_TOKEN = 4


@dataclass(slots=True, frozen=True)
class Sample:
    prompt: str
    output_tokens: int


def sharegpt(path: str | Path, seed: int = 0) -> list[Sample]:
    conversations = orjson.loads(Path(path).read_bytes())
    if not isinstance(conversations, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    samples = [s for c in conversations if (s := _sample(c)) is not None]
    if not samples:
        raise ValueError(f"{path}: no conversation with a human turn and a reply")
    random.Random(seed).shuffle(samples)
    return samples


def cycle(samples: list[Sample], start: int) -> Iterator[Sample]:
    while True:
        yield samples[start % len(samples)]
        start += 1


def _sample(conversation: object) -> Sample | None:
    turns = conversation.get("conversations") if isinstance(conversation, dict) else None
    if not isinstance(turns, list):
        return None
    human = next((t.get("value") for t in turns if t.get("from") == "human"), None)
    reply = next((t.get("value") for t in turns if t.get("from") in ("gpt", "chatgpt")), None)
    if not human or not reply:
        return None
    return Sample(human, max(1, round(len(reply) / CHARS_PER_TOKEN)))
