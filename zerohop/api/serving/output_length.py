"""How long an answer may be, decided once for every surface (`output_limit`).

A prompt that leaves no room for one output token is a 400 everywhere. An output length the
context cannot hold after the prompt is handled as each API's users expect:

API (field)                 past the context       absent
--------------------------  ---------------------  -------------
Messages (max_tokens)       clamped to the room    (required)
Responses (max_output_...)  clamped to the room    the room left
Chat, Completions           400 with the numbers   the room left
gRPC (max_tokens)           400 INVALID_ARGUMENT   the room left

Why: Claude Code and the Agents SDK ask Messages for 32,000 tokens or more of any model, which
a small model's context would refuse every time (Claude's newest models refuse instead);
Responses' `max_output_tokens` is an upper bound, and Codex sends none. Chat and Completions
refuse as vLLM and the OpenAI API do (`context_length_exceeded`); gRPC follows Chat.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from zerohop.api.errors import ApiError

Api = Literal["messages", "responses", "chat", "completions", "grpc"]


class Overflow(Enum):
    CLAMP = "clamp"  # to the room the context leaves
    REFUSE = "refuse"  # 400, naming the numbers


OVERFLOW: dict[Api, Overflow] = {
    "messages": Overflow.CLAMP,
    "responses": Overflow.CLAMP,
    "chat": Overflow.REFUSE,
    "completions": Overflow.REFUSE,
    "grpc": Overflow.REFUSE,
}


def output_limit(api: Api, prompt_tokens: int, max_tokens: int | None, context: int) -> int | None:
    """The output tokens a request may produce (None: up to the context); ApiError 400 for a
    prompt that leaves no room, or an overflowing `max_tokens` where the API refuses it."""
    overflow = OVERFLOW[api]
    if prompt_tokens >= context:
        raise ApiError(400, _prompt_too_long(overflow, prompt_tokens, context))
    if max_tokens is None or prompt_tokens + max_tokens <= context:
        return max_tokens
    if overflow is Overflow.CLAMP:
        return context - prompt_tokens
    raise ApiError(
        400,
        f"max_tokens is too large: {prompt_tokens} prompt tokens + {max_tokens}"
        f" max_tokens = {prompt_tokens + max_tokens} > {context}, this model's context",
        param="max_tokens",
    )


def _prompt_too_long(overflow: Overflow, prompt_tokens: int, context: int) -> str:
    if overflow is Overflow.CLAMP:  # the Anthropic API's words
        return f"prompt is too long: {prompt_tokens} tokens > {context - 1} maximum"
    return (
        f"prompt is too long: {prompt_tokens} tokens, but this model's context is"
        f" {context} tokens (prompt plus at least one output token)"
    )
