"""SSE framing of OpenAI streams: the generation driver's events (generation/events.py) as
chat.completion.chunk and text_completion chunks.

Each content chunk is a per-request pre-encoded prefix + `orjson.dumps(text)` + suffix: one
chunk per engine step (one token, normally), written the moment it arrives.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from zerohop.api.errors import ApiError, openai_body
from zerohop.api.generation.events import Admitted, Finish, Step, Usage
from zerohop.api.openai.output import LogprobFormatter, legacy_columns, openai_usage

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"  # an SSE comment: keeps a silent stream alive, clients skip it


def sse(body: Any) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


class Stream:
    """Pre-encoded SSE framing for one streamed request; subclasses fill in the choice.

    With `n` > 1 choices the chunks interleave them as the engine's steps come (each chunk
    names its choice's index), each choice opens and finishes with its own chunk, and the
    usage chunk comes once every choice has finished (`closing`)."""

    object_name = b""
    suffix = b""  # after a chunk's text when it carries nothing else (set per request)
    text_close: bytes  # closes the text's object before logprobs
    ping = PING

    def __init__(
        self,
        request_id: str,
        rid: str,
        model: str,
        include_usage: bool,
        formatter: LogprobFormatter,
        n: int = 1,
    ) -> None:
        self.request_id, self.formatter, self.n = request_id, formatter, n
        self.head = (
            b'data: {"id":"' + rid.encode() + b'","object":"' + self.object_name
            + b'","created":' + str(int(time.time())).encode()
            + b',"model":' + orjson.dumps(model) + b',"choices":['
        )  # fmt: skip
        self.tail = (b',"usage":null' if include_usage else b"") + b"}\n\n"
        self.include_usage = include_usage
        self.usage: Usage | None = None
        self.token_ids = False  # vLLM's `return_token_ids`: each choice carries its tokens
        # Each choice's chunk up to its text: the head and `{"index":i,...`.
        self.prefixes = [self.choice_head(i) for i in range(n)]

    def choice_head(self, index: int) -> bytes:
        raise NotImplementedError

    def opening(self, admitted: Admitted) -> bytes:
        return b"".join(self.open_choice(i) for i in range(self.n))

    def open_choice(self, index: int) -> bytes:
        return b""

    def step(self, step: Step) -> bytes:
        """One chunk per token, even one whose text is still held back; then the choice's
        finish chunk when this step is its last."""
        data = self.content(step) if step.token_ids else b""
        return data + self.finish_chunk(step)

    def finish_chunk(self, step: Step) -> bytes:
        if step.finish is None:
            return b""
        self.usage = step.finish.usage
        return self.head + self.finish_choice(step.choice, step.finish) + b"]" + self.tail

    def content(self, step: Step) -> bytes:
        prefix, text = self.prefixes[step.choice], orjson.dumps(step.text)
        logprobs = self.logprobs(step) if step.logprobs is not None else None
        if logprobs is None and not self.token_ids:
            return prefix + text + self.suffix
        ids = b',"token_ids":' + orjson.dumps(step.token_ids) if self.token_ids else b""
        return (
            prefix + text + self.text_close + b',"logprobs":' + (logprobs or b"null")
            + b',"finish_reason":null' + ids + b"}]" + self.tail
        )  # fmt: skip

    def logprobs(self, step: Step) -> bytes | None:
        """The chunk's encoded logprobs, or None when the request asked for none."""
        raise NotImplementedError

    async def closing(self) -> bytes:
        """After every choice's finish chunk: the usage chunk, when asked for."""
        if not self.include_usage or self.usage is None:
            return DONE
        usage = orjson.dumps(openai_usage(self.usage))
        return self.head + b'],"usage":' + usage + b"}\n\n" + DONE

    def failed(self, error: ApiError) -> bytes:
        return sse(openai_body(error, self.request_id)) + DONE

    def finish_choice(self, index: int, finish: Finish) -> bytes:
        raise NotImplementedError


def choice_index(index: int) -> bytes:
    return b'{"index":' + str(index).encode()


def _finish_fields(finish: Finish) -> bytes:
    return (
        b',"logprobs":null,"finish_reason":' + orjson.dumps(finish.reason.value)
        + b',"stop_reason":' + orjson.dumps(finish.stop) + b"}"
    )  # fmt: skip


class ChatStream(Stream):
    object_name = b"chat.completion.chunk"
    text_close = b"}"

    def __init__(self, *args: Any, top: int | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.top = top
        self.suffix = b'},"logprobs":null,"finish_reason":null}]' + self.tail

    def choice_head(self, index: int) -> bytes:
        return self.head + choice_index(index) + b',"delta":{"content":'

    def open_choice(self, index: int) -> bytes:
        delta = choice_index(index) + b',"delta":{"role":"assistant","content":""},'
        return self.head + delta + b'"logprobs":null,"finish_reason":null}]' + self.tail

    def logprobs(self, step: Step) -> bytes | None:
        if self.top is None:
            return None
        return orjson.dumps({"content": self.formatter.chat(step, self.top)})

    def finish_choice(self, index: int, finish: Finish) -> bytes:
        return choice_index(index) + b',"delta":{}' + _finish_fields(finish)


class CompletionStream(Stream):
    object_name = b"text_completion"
    text_close = b""

    def __init__(self, *args: Any, echo: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.echo = echo
        self.suffix = b',"logprobs":null,"finish_reason":null}]' + self.tail
        self.offsets = [0] * self.n  # each choice's text_offset so far

    def choice_head(self, index: int) -> bytes:
        return self.head + choice_index(index) + b',"text":'

    def open_choice(self, index: int) -> bytes:
        if not self.echo:
            return b""
        return self.prefixes[index] + orjson.dumps(self.echo) + self.suffix

    def logprobs(self, step: Step) -> bytes | None:
        # Each chunk carries its own tokens' logprobs; text_offset keeps counting.
        chunk = legacy_columns()
        self.offsets[step.choice] = self.formatter.legacy(step, chunk, self.offsets[step.choice])
        return orjson.dumps(chunk)

    def finish_choice(self, index: int, finish: Finish) -> bytes:
        return choice_index(index) + b',"text":""' + _finish_fields(finish)
