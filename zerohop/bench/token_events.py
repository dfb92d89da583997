"""The token events and usage of one streamed response, as `zerohop bench` counts them.

Each reader takes the response's byte chunks as they arrive, parses them with `zerohop.sse`
and stamps a token event (`StreamTimes.token_event`) for every event that carries a token.
Per event the OpenAI reader only looks for a few byte patterns in the data; JSON is parsed
(orjson) only for the usage and error chunks, so the client stays cheaper than the server it
measures.
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from typing import Any

import orjson

from zerohop.bench.load_types import StreamTimes
from zerohop.sse import Parser


async def read_openai(chunks: AsyncIterable[bytes], s: StreamTimes) -> None:
    parser = Parser()
    async for chunk in chunks:
        for event in parser.feed(chunk):
            payload = event.data
            if not payload:
                continue
            if payload == b"[DONE]":
                return
            # Compact JSON (orjson, pydantic) lets a token chunk be told apart without
            # parsing; escaped text can never contain these patterns.
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


def _openai_usage(s: StreamTimes, data: dict[str, Any]) -> None:
    usage = data.get("usage") or {}
    s.prompt_tokens = usage.get("prompt_tokens") or 0
    s.output_tokens = usage.get("completion_tokens") or 0


def _openai_other(s: StreamTimes, data: dict[str, Any]) -> None:
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


async def read_anthropic(chunks: AsyncIterable[bytes], s: StreamTimes) -> None:
    parser = Parser()
    async for chunk in chunks:
        for event in parser.feed(chunk):
            name, payload = event.name, event.data
            if not payload:
                continue
            if name == b"content_block_delta":
                s.token_event()
            elif name == b"message_start":
                usage = orjson.loads(payload)["message"].get("usage") or {}
                s.prompt_tokens = sum(
                    usage.get(k) or 0
                    for k in (
                        "input_tokens",
                        "cache_read_input_tokens",
                        "cache_creation_input_tokens",
                    )
                )
            elif name == b"message_delta":
                usage = orjson.loads(payload).get("usage") or {}
                s.output_tokens = usage.get("output_tokens") or 0
            elif name == b"error":
                error = orjson.loads(payload).get("error") or {}
                s.error = f"stream error: {error.get('message', error)}"
            elif name == b"message_stop":
                return
