"""The Anthropic Messages API: `POST /v1/messages` (streaming or not) and `count_tokens`.

Decisions where the API leaves room (see also schema.py):
- Text blocks of one message are concatenated as they are (blocks are often split only to
  place cache breakpoints); consecutive same-role turns are joined with a blank line.
- A final assistant message is a prefill: the prompt is the chat template's rendering of the
  turns before it, with the generation prompt, followed by the prefill text; the response
  continues from it. As in the API it may not end with whitespace.
- Usage: `input_tokens` excludes prefix-cache hits, which are `cache_read_input_tokens`;
  `cache_creation_input_tokens` is always 0 (caching is automatic and never billed as a write).
- A response without tools always holds one text block, possibly empty (tool use and
  thinking blocks: blocks.py, from the conversation's events), after the thinking block
  when the request thinks.
- `metadata.user_id`, `service_tier`, `cache_control`, `anthropic-version` and
  `anthropic-beta` (any value) are accepted and ignored, as is a query string (the SDK's
  beta calls add `?beta=true`); the key (`x-api-key` or `Authorization: Bearer`) is the
  gateway's (app.py). Context edits: anthropic/context.py; the response (and the stream's
  message_delta) carries `context_management` when the request had it.
- `max_tokens` beyond the room the context leaves after the prompt is clamped to that room
  (as llama.cpp's server does); a prompt that leaves no room is a 400 in the API's words
  (`prompt is too long: N tokens > M maximum`, M the context less one output token).
- The stream's headers and `message_start` go out once the request is admitted (the
  gateway and the engine accepted it), before the prefill, so a slow prefill never trips a
  client's first-byte timeout; a request refused before that still gets its HTTP error
  status. Then `event: ping` whenever nothing was written for `--stream-ping-interval`
  seconds (5; http/keepalive.py): during the prefill, a queue wait, a tool call read.
- `message_start`'s usage: `input_tokens` as known at admission, and the prefix-cache hit
  the engine expected when it accepted the request (`cache_read_input_tokens`, as the API
  reports it there). Blocks can be evicted before the request is scheduled: the final
  `message_delta` carries the whole usage as it was (input, cache reads, output), as the
  API's message_delta does, and that is the one to bill by.
- An identical request resent by the same key while the first runs (temperature 0, or an
  SDK's retry) gets the first one's response instead of a second computation
  (shared_runs.py).
- `thread` (the message-threads beta) keeps the conversation per tenant: anthropic/threads.py.
- A stream requested with `zerohop-send-times: 1` carries the server's send time as an SSE
  comment before each write's events (`: zerohop-sent <unix seconds>`; send_times.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from zerohop.api.anthropic.blocks import ContentBlocks
from zerohop.api.anthropic.context import Edited, edit_context
from zerohop.api.anthropic.schema import (
    CountTokensRequest,
    MessagesRequest,
    decode_count_tokens,
    decode_messages,
)
from zerohop.api.anthropic.threads import ThreadTurn, thread_error
from zerohop.api.anthropic.turns import conversation, thought_signatures
from zerohop.api.conversation.events import OutputReader
from zerohop.api.conversation.planner import plan, prompt_ids
from zerohop.api.conversation.reasoning import has_reasoning_format
from zerohop.api.conversation.request import Conversation
from zerohop.api.conversation.system_turns import takes_late_system
from zerohop.api.conversation.thought_signatures import ThoughtSigner
from zerohop.api.errors import ApiError, anthropic_body, server_cancelled
from zerohop.api.http.asgi import (
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    end_stream,
    read_json_body,
    request_id_headers,
    send_chunk,
    send_json,
    start_stream,
)
from zerohop.api.http.keepalive import Pings
from zerohop.api.http.send_times import with_send_times
from zerohop.api.service import ServingContext, sampling_params
from zerohop.api.shared_runs import may_attach, run_key
from zerohop.engine.base.outputs import RequestDelta
from zerohop.engine.sample.sampling_params import SamplingParams
from zerohop.gateway.gateway import Call

log = logging.getLogger(__name__)

_DELTA_PREFIX = (
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":'
)
_DELTA_SUFFIX = b"}}\n\n"
_DELTA_SUFFIX_IDS = b'},"token_ids":'  # `return_token_ids`: the event's tokens follow
_BLOCK_START = (
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}'
    b'\n\nevent: ping\ndata: {"type":"ping"}\n\n'
)
_PING = b'event: ping\ndata: {"type":"ping"}\n\n'
_BLOCK_STOP = b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
_MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def routes(ctx: ServingContext) -> dict:
    surface = AnthropicSurface(ctx)
    return {
        ("POST", "/v1/messages"): surface.messages,
        ("POST", "/v1/messages/count_tokens"): surface.count_tokens,
    }


class AnthropicSurface:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def count_tokens(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        request = decode_count_tokens(await self._body(scope, receive))
        self.ctx.check_model(request.model, call)
        signer = await self.signer(request, call, answers=False)
        conv, edited = self.conversation(request, signer)
        tokens = len(prompt_ids(conv, self.ctx))
        body: dict[str, Any] = {"input_tokens": tokens}
        if edited is not None:
            original = edited.original_tokens(tokens, self._counter(signer))
            body["context_management"] = {"original_input_tokens": original}
        await send_json(send, 200, body, request_id_headers(call.request_id))

    async def messages(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        body = await self._body(scope, receive)
        request = decode_messages(body)
        key = run_key(call, scope, body)  # an identical request running: attached to it
        attach = may_attach(scope, request.temperature)

        async def work(receive: Receive, send: Send) -> None:
            await self._messages(request, body, scope, receive, send, call)

        await self.ctx.runs.serve(key, attach, receive, send, work)

    async def _messages(
        self,
        request: MessagesRequest,
        body: bytes,
        scope: Scope,
        receive: Receive,
        send: Send,
        call: Call,
    ) -> None:
        self.ctx.check_model(request.model, call)
        request, thread = await self._thread(request, body, call)
        try:
            await self._generate(request, scope, receive, send, call, thread)
        finally:
            if thread is not None:  # no complete answer: nothing kept (threads.py)
                await asyncio.shield(thread.abandon())

    async def _thread(
        self, request: MessagesRequest, body: bytes, call: Call
    ) -> tuple[MessagesRequest, ThreadTurn | None]:
        """The request with its thread's turns before it, and its turn (anthropic/threads.py)."""
        if request.thread is None:
            return request, None
        if self.ctx.threads is None:
            raise thread_error(
                400, "thread_unsupported_request", "thread: not enabled on this server"
            )
        return await self.ctx.threads.begin(request, body, call.identity.tenant.name)

    async def _generate(
        self,
        request: MessagesRequest,
        scope: Scope,
        receive: Receive,
        send: Send,
        call: Call,
        thread: ThreadTurn | None,
    ) -> None:
        continues = request.continue_token_ids
        signer = await self.signer(request, call, answers=True)
        conv, edited = self.conversation(request, signer)
        if conv.tools and (request.return_token_ids or continues):
            raise ApiError(400, "tools: not supported with return_token_ids or continue_token_ids")
        planned = plan(conv, self.ctx, _sampling_params(request), continues)
        prompt = planned.prompt
        max_tokens = self.ctx.output_limit("messages", len(prompt), request.max_tokens)
        params = dataclasses.replace(planned.params, max_tokens=max_tokens)
        state = _Run(call.request_id, prompt, request.model, bool(request.return_token_ids))
        state.context = None if edited is None else edited.response()
        state.thread = thread
        if conv.tools or planned.in_thought is not None:
            state.reader = planned.reader()
            state.blocks = ContentBlocks(planned.in_thought is not None, bool(conv.tools), signer)
        generation = self.ctx.generate(
            call, prompt, params, receive, continues, announce=bool(request.stream)
        )
        async with contextlib.aclosing(generation) as deltas:
            if request.stream:
                interval = self.ctx.ping_interval
                await state.stream(deltas, with_send_times(scope, send), interval)
            else:
                await state.complete(deltas, send)

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        return await read_json_body(scope, receive, self.ctx.max_body_bytes, self.ctx.body_deadline)

    async def signer(self, request: CountTokensRequest, call: Call, answers: bool) -> ThoughtSigner:
        """The request's thought signer, for the served model and the caller's tenant (keys
        read first when needed); `answers`: the response may hold a thought to sign."""
        ctx = self.ctx
        signs = answers and has_reasoning_format(ctx.tokenizer.chat_template)
        tenant = call.identity.tenant.name
        signatures = thought_signatures(request)
        return await ctx.thoughts.signer(ctx.model_name, tenant, signatures, signs)

    def conversation(
        self, request: CountTokensRequest, signer: ThoughtSigner
    ) -> tuple[Conversation, Edited | None]:
        """The request's conversation, once its context edits are applied (and those)."""
        edited = edit_context(request, self._counter(signer))
        return self._conversation(request if edited is None else edited.request, signer), edited

    def _conversation(self, request: CountTokensRequest, signer: ThoughtSigner) -> Conversation:
        tokenizer = self.ctx.tokenizer
        late = takes_late_system(tokenizer)
        return conversation(request, tokenizer.chat_template, late, signer)

    def _counter(self, signer: ThoughtSigner) -> Callable[[CountTokensRequest], int]:
        """A request's prompt tokens (context edits' triggers and cleared counts)."""
        return lambda request: len(prompt_ids(self._conversation(request, signer), self.ctx))


class _Run:
    """One generation request's response, streamed as SSE events or sent whole."""

    def __init__(self, rid: str, prompt: list[int], model: str, token_ids: bool) -> None:
        self.rid, self.model = rid, model
        self.suffix = _DELTA_SUFFIX_IDS if token_ids else None
        self.num_prompt = len(prompt)
        self.cached = 0
        self.output_tokens = 0
        # Set when the request has tools or thinks: the output read as events, into blocks.
        self.reader: OutputReader | None = None
        self.blocks: ContentBlocks | None = None
        self.context: dict[str, Any] | None = None  # context_management (applied edits)
        self.thread: ThreadTurn | None = None  # its answer is kept (anthropic/threads.py)
        self.text: list[str] = []  # a threaded stream's text, for the kept answer

    async def complete(self, deltas: AsyncIterator[RequestDelta], send: Send) -> None:
        pieces: list[str] = []
        async for delta in deltas:
            self._count(delta)
            pieces.append(delta.new_text)
            self._blocks(delta)
            if delta.finished:
                break
        stop_reason, stop_sequence = self._finish(delta)
        content = [{"type": "text", "text": "".join(pieces)}]
        if self.blocks is not None:
            content = self.blocks.content()
        body = {
            **self._message(),
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": self._usage(),
        }
        if self.context is not None:
            body["context_management"] = self.context
        if self.thread is not None:  # kept before it is sent: the next turn finds it
            await self.thread.answered(body["id"], content)
        await send_json(send, 200, body, request_id_headers(self.rid))

    async def stream(
        self, deltas: AsyncIterator[RequestDelta], send: Send, ping_interval: float
    ) -> None:
        # Errors before admission become the HTTP status (the app sends them).
        delta = await anext(deltas)
        self._count(delta)
        await start_stream(send, request_id_headers(self.rid))
        start = {**self._message(), "content": [], "stop_reason": None, "stop_sequence": None}
        start["usage"] = self._usage()
        first = _BLOCK_START if self.blocks is None else self.blocks.opening() + _PING
        await send_chunk(send, _event("message_start", {"message": start}) + first)
        pings = Pings(deltas, ping_interval)
        try:
            async with contextlib.aclosing(pings.items()) as items:
                stop_reason, stop_sequence = await self._follow(delta, items, pings, send)
        except ClientDisconnected:
            await end_stream(send)
            raise
        except ApiError as exc:
            return await end_stream(send, _event("error", anthropic_body(exc, self.rid)))
        except Exception:
            log.exception("request %s failed mid-stream", self.rid)
            error = ApiError(500, "internal server error")
            return await end_stream(send, _event("error", anthropic_body(error, self.rid)))
        end: dict[str, Any] = {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        }
        end["usage"] = self._usage()
        if self.context is not None:
            end["context_management"] = self.context
        stop = _BLOCK_STOP if self.blocks is None else self.blocks.end()
        if self.thread is not None:  # kept before message_stop: the next turn finds it
            await self.thread.answered(self._message()["id"], self._content())
        await end_stream(send, stop + _event("message_delta", end) + _MESSAGE_STOP)

    async def _follow(
        self,
        delta: RequestDelta,
        items: AsyncIterator[RequestDelta | None],
        pings: Pings[RequestDelta],
        send: Send,
    ) -> tuple[str, str | None]:
        """Each delta's events (from `delta`, the admission or an error, on), a ping when
        nothing was written for a while; the final delta's (stop_reason, stop_sequence)."""
        if not delta.admitted and (chunk := self._chunk(delta)):
            await send_chunk(send, chunk)
        while not delta.finished:
            item = await anext(items)
            if item is None:
                await send_chunk(send, _PING)
                continue
            delta = item
            self._count(delta)
            chunk = self._chunk(delta)
            if chunk:
                await send_chunk(send, chunk)
                pings.wrote()
        return self._finish(delta)

    def _chunk(self, delta: RequestDelta) -> bytes:
        if self.blocks is not None:
            return self._blocks(delta)
        if delta.new_token_ids:  # one event per token, even one with no text yet
            return self._delta_event(delta)
        return b""

    def _blocks(self, delta: RequestDelta) -> bytes:
        """The step's output through the reader into the content blocks (their events)."""
        if self.reader is None or self.blocks is None:
            return b""
        events = self.reader.feed(delta.new_text, final=delta.finished)
        return self.blocks.events(events, final=delta.finished)

    def _delta_event(self, delta: RequestDelta) -> bytes:
        text = orjson.dumps(delta.new_text)
        if self.suffix is None:
            return _DELTA_PREFIX + text + _DELTA_SUFFIX
        return _DELTA_PREFIX + text + self.suffix + orjson.dumps(delta.new_token_ids) + b"}\n\n"

    def _count(self, delta: RequestDelta) -> None:
        self.output_tokens += len(delta.new_token_ids)
        self.cached = delta.cached_tokens
        if self.thread is not None:
            self.text.append(delta.new_text)

    def _content(self) -> list[dict[str, Any]]:
        """The answer's content blocks, once its output is all read."""
        if self.blocks is not None:
            return self.blocks.content()
        return [{"type": "text", "text": "".join(self.text)}]

    def _finish(self, delta: RequestDelta) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the final delta; ApiError when it failed."""
        reason = delta.finish_reason
        if reason == "error":
            raise ApiError(500, f"generation failed: {delta.error}")
        if reason not in _STOP_REASONS:  # "abort": the server's (the client's ends earlier)
            raise server_cancelled(529)
        if self.blocks is not None and self.blocks.calls:
            return "tool_use", None
        if reason == "stop" and isinstance(delta.stop_reason, str):
            return "stop_sequence", delta.stop_reason
        return _STOP_REASONS[reason], None

    def _message(self) -> dict[str, Any]:
        return {
            "id": "msg_" + self.rid.removeprefix("req_"),
            "type": "message",
            "role": "assistant",
            "model": self.model,
        }

    def _usage(self) -> dict[str, int]:
        return {
            "input_tokens": self.num_prompt - self.cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.cached,
            "output_tokens": self.output_tokens,
        }


def _sampling_params(request: MessagesRequest) -> SamplingParams:
    return sampling_params(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        max_tokens=request.max_tokens,
        stop=request.stop_sequences,
    )


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (
        name.encode(),
        orjson.dumps({"type": name, **data}),
    )
