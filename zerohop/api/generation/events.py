"""What the generation driver emits: the life of one request, the same for every surface.

A streamed request begins with `Admitted` (the gateway and the engine accepted it: a stream
may start); then, in any order, `Ping` (nothing was written for the ping interval) and `Step`
(one engine step of one choice: its tokens, text, logprobs and output events, and its
`Finish` on the choice's last step); a failure once admitted is `Failed`, the last event.
A whole (not streamed) request gets no `Admitted` and no `Ping`. A failure before admission,
and a client that went away, are raised instead (`ApiError`, `ClientDisconnected`): there is
no stream to write them to.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from zerohop.api.conversation.events import Event
from zerohop.api.errors import ApiError


class FinishReason(Enum):
    STOP = "stop"  # the end of the sequence, or a stop string or token
    LENGTH = "length"  # max_tokens, or the end of the context
    TOOL_CALLS = "tool_calls"  # the choice made tool calls, whatever ended it


@dataclass(slots=True)
class Usage:
    """The request's tokens so far: the prompt once, the output of every choice."""

    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens read from the prefix cache
    thought_tokens: int = 0  # output tokens inside a thought

    @property
    def uncached_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(slots=True)
class Admitted:
    """The request was admitted; `usage.cached_tokens`: the prefix hit the engine expects."""

    usage: Usage


@dataclass(slots=True)
class Ping:
    """Nothing was written for the ping interval: a keep-alive is due."""


@dataclass(slots=True)
class Finish:
    """How a choice ended. `truncated`: at max_tokens or the context (also with calls)."""

    reason: FinishReason
    truncated: bool
    stop: str | int | None  # the stop string or stop token that ended it
    thought: str | None  # the choice's whole thought; None when it opened none
    usage: Usage


@dataclass(slots=True)
class Step:
    """One engine step of one choice. `output`: its text read as events (thought, text, tool
    calls); a request without a reader gets its text as one `Text`."""

    choice: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    output: list[Event]
    finish: Finish | None = None


@dataclass(slots=True)
class Failed:
    """The request failed after it was admitted (the engine's error, a server abort, the
    engine's death); `error.kind` says which."""

    error: ApiError


GenerationEvent = Admitted | Ping | Step | Failed
