"""What the probe sends to each API surface, and which stream events are tokens.

A token event is one that carries generated text (possibly empty: zerohop sends one event
per token even while the detokenizer holds its text back); role openings, finish chunks,
usage chunks, pings and `[DONE]` are not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ANTHROPIC_VERSION = "2023-06-01"


@dataclass(slots=True, frozen=True)
class Endpoint:
    path: str
    body: Callable[[str, str, int], dict[str, Any]]  # (model, prompt, max_tokens) -> JSON
    is_token: Callable[[str | None, Any], bool]  # (event name, decoded data)
    output_tokens: Callable[[str | None, Any], int | None]  # usage the stream reports
    extra_headers: dict[str, str]


def _messages_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    return {"model": model, "max_tokens": max_tokens, "messages": messages, "stream": True}


def _chat_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {**_messages_body(model, prompt, max_tokens), "stream_options": {"include_usage": True}}


def _completions_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _anthropic_token(name: str | None, data: Any) -> bool:
    return name == "content_block_delta" and data.get("delta", {}).get("type") == "text_delta"


def _anthropic_usage(name: str | None, data: Any) -> int | None:
    return data.get("usage", {}).get("output_tokens") if name == "message_delta" else None


def _first_choice(data: Any) -> dict[str, Any] | None:
    choices = data.get("choices") if isinstance(data, dict) else None
    return choices[0] if choices else None


def _chat_token(name: str | None, data: Any) -> bool:
    choice = _first_choice(data)
    if choice is None:
        return False
    content = choice.get("delta", {}).get("content")
    if content is None:
        return False
    opening = "role" in choice["delta"] or choice.get("finish_reason") is not None
    return content != "" or not opening


def _completion_token(name: str | None, data: Any) -> bool:
    choice = _first_choice(data)
    if choice is None or choice.get("text") is None:
        return False
    return choice["text"] != "" or choice.get("finish_reason") is None


def _openai_usage(name: str | None, data: Any) -> int | None:
    usage = data.get("usage") if isinstance(data, dict) else None
    return usage.get("completion_tokens") if isinstance(usage, dict) else None


ENDPOINTS: dict[str, Endpoint] = {
    "openai-chat": Endpoint("/v1/chat/completions", _chat_body, _chat_token, _openai_usage, {}),
    "openai-completions": Endpoint(
        "/v1/completions", _completions_body, _completion_token, _openai_usage, {}
    ),
    "anthropic-messages": Endpoint(
        "/v1/messages",
        _messages_body,
        _anthropic_token,
        _anthropic_usage,
        {"anthropic-version": ANTHROPIC_VERSION},
    ),
}
