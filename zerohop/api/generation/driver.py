"""The generation driver: one request's life from admission to its last token, once for all
surfaces (events.py says what it emits).

In order: the output-length policy (`zerohop.api.serving.output_length`), admission (overload, rate
limits and budget: `ServingContext.admit`), the engine request, each step charged to the
caller's limits and budget as it comes, each choice's output read by its own reader (thought,
text, tool calls), usage counted, and the end: a finish per choice, or one error of a known
kind. A client that goes away (an ASGI `receive` that reports it) aborts the request in the
engine and ends it with `ClientDisconnected`, recorded as 499 on every surface.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from zerohop.api.conversation.events import Event, OutputReader, Text
from zerohop.api.errors import ApiError, server_cancelled
from zerohop.api.generation.events import (
    Admitted,
    Failed,
    Finish,
    FinishReason,
    GenerationEvent,
    Ping,
    Step,
    Usage,
)
from zerohop.api.http.asgi import ClientDisconnected, Receive, on_disconnect
from zerohop.api.http.keepalive import Pings
from zerohop.api.serving.output_length import Api
from zerohop.api.serving.service import ServingContext, engine_options
from zerohop.engine.base.errors import EngineDeadError, InvalidRequestError
from zerohop.engine.base.outputs import RequestDelta
from zerohop.engine.sample.sampling_params import SamplingParams
from zerohop.gateway.gateway import Call

# The overload status of each API, for an abort the server made (a drain, shedding).
_OVERLOAD_STATUS: dict[Api, int] = {"messages": 529}
_OPENAI_PING_APIS: frozenset[Api] = frozenset({"chat", "completions"})
_PING = Ping()


@dataclass(slots=True)
class GenerationRequest:
    """What a surface asks the driver to run. `readers`: a reader per choice (None: the text
    goes out as decoded); `continues`: the end of `prompt` is a partial answer to resume
    (a client's failover; one choice): its text is read first, without events for it."""

    api: Api
    prompt: list[int]
    params: SamplingParams
    readers: Callable[[], OutputReader] | None = None
    continues: list[int] | None = None


class Generation:
    """One request's events (`events()`); streamed when `stream`, with a ping whenever nothing
    was written for the API's interval (the encoder calls `wrote()` after each write)."""

    def __init__(
        self,
        ctx: ServingContext,
        call: Call,
        request: GenerationRequest,
        receive: Receive | None = None,
        stream: bool = False,
    ) -> None:
        self.ctx, self.call, self.request = ctx, call, request
        self.receive, self.stream = receive, stream
        self.usage = Usage(len(request.prompt))
        self.readers: dict[int, OutputReader] = {}
        self.unfinished = request.params.n
        self._pings: Pings[RequestDelta] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._keep_text = False  # --audit-content: the answer is kept for the audit record
        self._gone = False
        self.continued_text, self.resumed = self._resume()

    @property
    def done(self) -> bool:
        """Every choice has finished."""
        return self.unfinished <= 0

    def wrote(self) -> None:
        """Something was written: the next ping is due an interval from now."""
        if self._pings is not None:
            self._pings.wrote()

    async def steps(self) -> AsyncGenerator[Step, None]:
        """A whole response's steps: a failure is raised, as nothing was sent yet."""
        async with contextlib.aclosing(self.events()) as events:
            async for event in events:
                if isinstance(event, Step):
                    yield event
                elif isinstance(event, Failed):
                    raise event.error

    async def events(self) -> AsyncGenerator[GenerationEvent, None]:
        # One generator from the engine's deltas to the encoder: each layer costs every token.
        started = False
        try:
            deltas = await self._start()
            try:
                # aclosing: closing this generator closes the engine's at once, which aborts
                # the request, instead of whenever the garbage collector finalizes it.
                async with contextlib.aclosing(deltas):
                    source: AsyncGenerator[RequestDelta | None, None] = deltas
                    if self.stream:
                        first = await anext(deltas)
                        usage = Usage(self.usage.prompt_tokens, cached_tokens=first.cached_tokens)
                        # An engine that does not announce: its failure still precedes the stream.
                        step = None if first.admitted else self._step(first)
                        started = True
                        yield Admitted(usage)
                        if step is not None:
                            yield step
                        self._pings = Pings(deltas, self._ping_interval())
                        source = self._pings.items()
                    async with contextlib.aclosing(source):
                        async for item in source:
                            if item is None:
                                yield _PING
                                continue
                            step = self._step(item)
                            started = True
                            yield step
                            if self.done:
                                return
            finally:
                self._end()
        except InvalidRequestError as exc:
            error = ApiError(400, str(exc))
        except EngineDeadError:
            error = self.ctx.lost_error(self.call.surface)
        except ApiError as exc:
            error = exc
        else:
            return
        if not started:
            raise error
        yield Failed(error)

    async def _start(self) -> AsyncGenerator[RequestDelta, None]:
        """The output-length policy and admission, then the engine's request."""
        ctx, call, request = self.ctx, self.call, self.request
        prompt = request.prompt
        max_tokens = ctx.output_limit(request.api, len(prompt), request.params.max_tokens)
        params = dataclasses.replace(request.params, max_tokens=max_tokens)
        options = engine_options(call, request.continues)
        params = await ctx.admit(call, prompt, params, options)
        if self.receive is not None:
            self._watcher = on_disconnect(self.receive, self._client_gone)
        deltas = ctx.engine.generate(call.request_id, prompt, params, self.stream, options)
        if call.queue_timing is not None:
            call.queue_timing.sent()
        self._keep_text = ctx.gateway is not None and ctx.gateway.audits_content
        if self._keep_text:  # --audit-content: the prompt as the model saw it, and the answer
            call.prompt_text = ctx.tokenizer.decode(prompt, skip_special_tokens=False)
        return deltas

    def _end(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self.ctx.gateway is not None:
            self.ctx.gateway.release(self.call)

    def _ping_interval(self) -> float:
        if self.request.api in _OPENAI_PING_APIS:
            return self.ctx.openai_ping_interval
        return self.ctx.ping_interval

    def _client_gone(self) -> None:
        self._gone = True
        self.ctx.engine.abort(self.call.request_id)

    def _resume(self) -> tuple[str, list[Event]]:
        """The continued tokens' text (as the engine's detokenizer replays it: an incomplete
        last character is held back) and the events its reader made of it, none of which go
        out: the caller has them. So a call or thought begun before the failover goes on
        where it stopped, in the same reader (tools/parsers, reasoning)."""
        continues = self.request.continues
        if not continues:
            return "", []
        skip = self.request.params.skip_special_tokens
        text = self.ctx.tokenizer.decode(continues, skip_special_tokens=skip).rstrip("\ufffd")
        factory = self.request.readers
        if factory is None:
            return text, []
        reader = self.readers[0] = factory()
        return text, reader.feed(text)

    def _step(self, delta: RequestDelta) -> Step:
        """A step charged to the caller, read, counted; its choice's finish when it ends."""
        self._charge(delta)
        usage = self.usage
        tokens = len(delta.new_token_ids)
        usage.output_tokens += tokens
        usage.cached_tokens = max(usage.cached_tokens, delta.cached_tokens)
        output = self._read(delta, tokens)
        step = Step(delta.index, delta.new_token_ids, delta.new_text, delta.new_logprobs, output)
        if delta.finished:
            step.finish = self._finish(delta)
        return step

    def _charge(self, delta: RequestDelta) -> None:
        call, gateway = self.call, self.ctx.gateway
        timing = call.queue_timing
        if timing is not None and timing.actual is None:
            timing.first_delta(self._step_seconds())
        if gateway is not None:
            now = time.monotonic()
            gateway.on_delta(call, len(delta.new_token_ids), delta.cached_tokens, now)
            if self._keep_text:
                call.output_text.append(delta.new_text)

    def _step_seconds(self) -> float:
        """The time of the engine's latest step (the one whose deltas are coming in)."""
        stats = self.ctx.engine.latest_stats
        return 0.0 if stats is None else stats["step_seconds"]

    def _read(self, delta: RequestDelta, tokens: int) -> list[Event]:
        factory = self.request.readers
        if factory is None:
            return [Text(delta.new_text)] if delta.new_text else []
        reader = self.readers.get(delta.index)
        if reader is None:
            reader = self.readers[delta.index] = factory()
        if reader.thoughts is not None and not reader.thought_ended:
            self.usage.thought_tokens += tokens
        return reader.feed(delta.new_text, final=delta.finished)

    def _finish(self, delta: RequestDelta) -> Finish:
        """The choice's end; ApiError when it ended without an answer to send."""
        reason = delta.finish_reason
        self.call.stop_reason = reason
        if reason == "error":
            raise ApiError(500, f"generation failed: {delta.error or 'engine error'}")
        if reason not in ("stop", "length"):  # "abort"
            if self._gone:
                raise ClientDisconnected
            raise server_cancelled(_OVERLOAD_STATUS.get(self.request.api, 503))
        self.unfinished -= 1
        reader = self.readers.get(delta.index)
        called = reader is not None and bool(reader.found)
        thought = reader.thought if reader is not None and reader.thought_opened else None
        return Finish(
            FinishReason.TOOL_CALLS if called else FinishReason(reason),
            truncated=reason == "length",
            stop=delta.stop_reason,
            thought=thought,
            usage=self.usage,
        )
