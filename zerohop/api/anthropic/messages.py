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
import logging
from collections.abc import Callable
from typing import Any

from zerohop.api.anthropic import compaction
from zerohop.api.anthropic.blocks import ContentBlocks
from zerohop.api.anthropic.context import (
    Edited,
    compaction_signatures,
    compacts,
    edit_context,
    expand_compactions,
)
from zerohop.api.anthropic.message_encoder import MessageEncoder
from zerohop.api.anthropic.schema import (
    Compact,
    CountTokensRequest,
    MessagesRequest,
    decode_count_tokens,
    decode_messages,
)
from zerohop.api.anthropic.threads import Threads, ThreadTurn, thread_error
from zerohop.api.anthropic.turns import conversation, thought_signatures
from zerohop.api.compaction.seal import Sealer
from zerohop.api.compaction.summarize import summarize
from zerohop.api.conversation.planner import plan, prompt_ids
from zerohop.api.conversation.reasoning import has_reasoning_format
from zerohop.api.conversation.request import Conversation
from zerohop.api.generation.driver import Generation, GenerationRequest
from zerohop.api.generation.sse import send_stream
from zerohop.api.http.asgi import (
    Handler,
    Receive,
    Scope,
    Send,
    read_json_body,
    request_id_headers,
    send_json,
)
from zerohop.api.http.send_times import with_send_times
from zerohop.api.serving.service import ServingContext, sampling_params
from zerohop.api.serving.shared_runs import may_attach, run_key
from zerohop.api.serving.thought_signatures import ThoughtSigner
from zerohop.engine.sample.sampling_params import SamplingParams
from zerohop.gateway.gateway import Call

log = logging.getLogger(__name__)


def routes(ctx: ServingContext, threads: Threads | None = None) -> dict[tuple[str, str], Handler]:
    surface = AnthropicSurface(ctx, threads)
    return {
        ("POST", "/v1/messages"): surface.messages,
        ("POST", "/v1/messages/count_tokens"): surface.count_tokens,
    }


class AnthropicSurface:
    """`threads`: where message threads are kept; None: a request's `thread` is refused."""

    def __init__(self, ctx: ServingContext, threads: Threads | None = None) -> None:
        self.ctx, self.threads = ctx, threads

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
            await self._compacting(request, scope, receive, send, call, thread)
        finally:
            if thread is not None:  # no complete answer: nothing kept (threads.py)
                await asyncio.shield(thread.abandon())

    async def _thread(
        self, request: MessagesRequest, body: bytes, call: Call
    ) -> tuple[MessagesRequest, ThreadTurn | None]:
        """The request with its thread's turns before it, and its turn (anthropic/threads.py)."""
        if request.thread is None:
            return request, None
        if self.threads is None:
            raise thread_error(
                400, "thread_unsupported_request", "thread: not enabled on this server"
            )
        return await self.threads.begin(request, body, call.identity.tenant.name)

    async def _compacting(
        self,
        request: MessagesRequest,
        scope: Scope,
        receive: Receive,
        send: Send,
        call: Call,
        thread: ThreadTurn | None,
    ) -> None:
        """Compaction first where the request asks for it (anthropic/compaction.py)."""
        compaction.check(request)
        edits = request.context_management.edits if request.context_management else None
        if request.compaction is None and not any(isinstance(e, Compact) for e in edits or ()):
            return await self._generate(request, scope, receive, send, call, thread)
        signer = await self.signer(request, call, answers=True)
        conv, edited = self.conversation(request, signer)
        edit = None if edited is None else edited.compact
        if request.compaction is None and edit is None:
            return await self._generate(request, scope, receive, send, call, thread)
        asked = request.compaction.instructions if request.compaction else None
        instructions = edit.instructions if edit is not None else asked
        summary = await summarize(self.ctx, call, conv, "messages", instructions)
        made = compaction.block(summary, Sealer(signer))
        done = compaction.applied(summary)
        context = None if edited is None else {"applied_edits": [*edited.applied, done]}
        if edit is None or edit.pause_after_compaction or request.stream:
            await compaction.send_block_only(send, request, call.request_id, made, summary, context)
            return
        going_on = compaction.compacted(request, made)
        send = compaction.leading(send, made, done, summary)
        await self._generate(going_on, scope, receive, send, call, thread)

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
        planned = plan(conv, self.ctx, _sampling_params(request), continues)
        encoder = MessageEncoder(call.request_id, request.model, bool(request.return_token_ids))
        encoder.context = None if edited is None else edited.response()
        encoder.thread = thread
        readers = None
        if conv.tools or planned.in_thought is not None:
            readers = planned.reader
            encoder.blocks = ContentBlocks(planned.in_thought is not None, bool(conv.tools), signer)
        wanted = GenerationRequest("messages", planned.prompt, planned.params, readers, continues)
        generation = Generation(self.ctx, call, wanted, receive, stream=bool(request.stream))
        if continues:
            encoder.resume(generation)
        headers = request_id_headers(call.request_id)
        if request.stream:
            await send_stream(generation, encoder, with_send_times(scope, send), headers)
        else:
            await send_json(send, 200, await encoder.whole(generation), headers)

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        return await read_json_body(scope, receive, self.ctx.max_body_bytes, self.ctx.body_deadline)

    async def signer(self, request: CountTokensRequest, call: Call, answers: bool) -> ThoughtSigner:
        """The request's thought signer, for the served model and the caller's tenant (keys
        read first when needed); `answers`: the response may hold a thought to sign."""
        ctx = self.ctx
        signs = answers and has_reasoning_format(ctx.tokenizer.chat_template)
        tenant = call.identity.tenant.name
        signatures = [*thought_signatures(request), *compaction_signatures(request)]
        signs = signs or (answers and compacts(request))
        return await ctx.thoughts.signer(ctx.model_name, tenant, signatures, signs)

    def conversation(
        self, request: CountTokensRequest, signer: ThoughtSigner
    ) -> tuple[Conversation, Edited | None]:
        """The request's conversation, once its context edits are applied (and those)."""
        request = expand_compactions(request, Sealer(signer))  # anthropic/context.py
        edited = edit_context(request, self._counter(signer))
        return self._conversation(request if edited is None else edited.request, signer), edited

    def _conversation(self, request: CountTokensRequest, signer: ThoughtSigner) -> Conversation:
        return conversation(request, self.ctx.tokenizer.chat_template, signer)

    def _counter(self, signer: ThoughtSigner) -> Callable[[CountTokensRequest], int]:
        """A request's prompt tokens (context edits' triggers and cleared counts)."""
        return lambda request: len(prompt_ids(self._conversation(request, signer), self.ctx))


def _sampling_params(request: MessagesRequest) -> SamplingParams:
    return sampling_params(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        max_tokens=request.max_tokens,
        stop=request.stop_sequences,
    )
