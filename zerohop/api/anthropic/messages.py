"""The Anthropic Messages API: `POST /v1/messages` (streaming or not) and `count_tokens`.

Decisions where the API leaves room (see also anthropic_schema.py):
- Text blocks of one message are concatenated as they are (blocks are often split only to
  place cache breakpoints); consecutive same-role turns are joined with a blank line.
- A final assistant message is a prefill: the prompt is the chat template's rendering of the
  turns before it, with the generation prompt, followed by the prefill text; the response
  continues from it. As in the API it may not end with whitespace.
- Usage: `input_tokens` excludes prefix-cache hits, which are `cache_read_input_tokens`;
  `cache_creation_input_tokens` is always 0 (caching is automatic and never billed as a write).
- A response without tools always holds one text block, possibly empty (tool use:
  anthropic_tools.py), after the thinking block when the request thinks
  (anthropic_thinking.py).
- `metadata.user_id`, `service_tier`, `cache_control` and `anthropic-version` are accepted
  and ignored; the key (`x-api-key` or `Authorization: Bearer`) is the gateway's (app.py).
- The stream's headers go out with the engine's first delta, so a request the engine
  rejects still gets a proper HTTP error status, and `message_start` can report cache reads.
- A stream requested with `zerohop-send-times: 1` carries the server's send time as an SSE
  comment before each write's events (`: zerohop-sent <unix seconds>`; send_times.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson

from zerohop.api.anthropic.schema import (
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    decode_count_tokens,
    decode_messages,
)
from zerohop.api.anthropic.thinking import (
    START,
    ThinkingEvents,
    ThinkingOutput,
    check_thinking,
    thinking_mode,
    with_budget,
)
from zerohop.api.anthropic.tools import (
    ToolEvents,
    ToolOutput,
    auto_grammar,
    check_content,
    forced_grammar,
    neutral_turns,
    request_tools,
    uses_tools,
    with_system_and_prefill,
)
from zerohop.api.conversation.reasoning import ReasoningParser, opens_thought
from zerohop.api.errors import ApiError, anthropic_body
from zerohop.api.http.asgi import (
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
from zerohop.api.http.send_times import with_send_times
from zerohop.api.service import ServingContext, sampling_params
from zerohop.api.tools.prompt import render_messages
from zerohop.api.tools.spec import Tool
from zerohop.engine.errors import InvalidRequestError
from zerohop.engine.outputs import RequestDelta
from zerohop.engine.sample.sampling_params import SamplingParams
from zerohop.engine.structured.grammar import json_schema_grammar
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
        prompt = self.prompt(request, self.thinking(request))
        headers = request_id_headers(call.request_id)
        await send_json(send, 200, {"input_tokens": len(prompt)}, headers)

    async def messages(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        request = decode_messages(await self._body(scope, receive))
        self.ctx.check_model(request.model, call)
        continues = request.continue_token_ids
        thinks = self.thinking(request)
        prompt = self.ctx.continued(self.prompt(request, thinks), continues)
        self.ctx.check_lengths(len(prompt), request.max_tokens)
        tools = request_tools(request)
        if tools and (request.return_token_ids or continues):
            raise ApiError(400, "tools: not supported with return_token_ids or continue_token_ids")
        params = _sampling_params(request, tools)
        params.grammar = params.grammar or auto_grammar(
            request, tools, self.ctx.tool_parser, thinks
        )
        state = _Run(call.request_id, prompt, request.model, request.return_token_ids)
        if tools:
            state.tools = ToolOutput.of(request, tools, self.ctx.tool_parser)
        if thinks:
            check_thinking(request, params.grammar)
            opened = opens_thought(self.ctx.tokenizer, prompt)
            params = with_budget(params, request, opened)
            state.thinking = ThinkingOutput(ReasoningParser(in_thought=opened), state.tools)
        generation = self.ctx.generate(call, prompt, params, receive, continues)
        async with contextlib.aclosing(generation) as deltas:
            if request.stream:
                await state.stream(deltas, with_send_times(scope, send))
            else:
                await state.complete(deltas, send)

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        return await read_json_body(scope, receive, self.ctx.max_body_bytes, self.ctx.body_deadline)

    def thinking(self, request: CountTokensRequest) -> bool | None:
        """Whether to think (None: the model has no reasoning format); anthropic_thinking.py."""
        template = self.ctx.tokenizer.chat_template
        return thinking_mode(request, template, self.ctx.model_name)

    def prompt(self, request: CountTokensRequest, thinks: bool | None = None) -> list[int]:
        extra: dict[str, Any] = {}
        if uses_tools(request):
            tools = request_tools(request)
            turns, prefill = neutral_turns(request)
            turns, extra = render_messages(turns, tools, self.ctx.tokenizer.chat_template)
        else:
            turns, prefill = chat_turns(request)
        if thinks is not None:
            extra = {**extra, "enable_thinking": thinks}
        if prefill is None and not extra:
            return self.ctx.encode_chat(turns)
        tokenizer = self.ctx.tokenizer
        try:
            text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, **extra)
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        return tokenizer.encode(text + (prefill or ""), add_special_tokens=False)


class _Run:
    """One generation request's response, streamed as SSE events or sent whole."""

    def __init__(self, rid: str, prompt: list[int], model: str, token_ids: bool) -> None:
        self.rid, self.model = rid, model
        self.suffix = _DELTA_SUFFIX_IDS if token_ids else None
        self.num_prompt = len(prompt)
        self.cached = 0
        self.output_tokens = 0
        self.tools: ToolOutput | None = None  # set when the request has tools
        self.thinking: ThinkingOutput | None = None  # set when the request thinks

    async def complete(self, deltas: AsyncIterator[RequestDelta], send: Send) -> None:
        pieces: list[str] = []
        async for delta in deltas:
            self._count(delta)
            pieces.append(delta.new_text)
            if self.thinking is not None:
                self.thinking.feed(delta.new_text, final=delta.finished)
            elif self.tools is not None:
                self.tools.feed(delta.new_text, final=delta.finished)
            if delta.finished:
                break
        stop_reason, stop_sequence = self._finish(delta)
        content = [{"type": "text", "text": "".join(pieces)}]
        if self.thinking is not None:
            content = self.thinking.content()
        elif self.tools is not None:
            content = self.tools.content()
        body = {
            **self._message(),
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": self._usage(),
        }
        await send_json(send, 200, body, request_id_headers(self.rid))

    async def stream(self, deltas: AsyncIterator[RequestDelta], send: Send) -> None:
        # Errors before the first delta become the HTTP status (the app sends them).
        delta = await anext(deltas)
        self._count(delta)
        await start_stream(send, request_id_headers(self.rid))
        start = {**self._message(), "content": [], "stop_reason": None, "stop_sequence": None}
        start["usage"] = self._usage()
        first = _BLOCK_START if self.tools is None else _PING
        if self.thinking is not None:
            first = START + _PING
        await send_chunk(send, _event("message_start", {"message": start}) + first)
        blocks = ToolEvents()
        thoughts = None if self.thinking is None else ThinkingEvents(self.thinking)
        try:
            while True:
                if thoughts is not None:
                    if chunk := thoughts.events(delta.new_text, delta.finished):
                        await send_chunk(send, chunk)
                elif self.tools is not None:
                    new = self.tools.feed(delta.new_text, final=delta.finished)
                    if chunk := blocks.events(*new):
                        await send_chunk(send, chunk)
                elif delta.new_token_ids:  # one event per token, even one with no text yet
                    await send_chunk(send, self._delta_event(delta))
                if delta.finished:
                    break
                delta = await anext(deltas)
                self._count(delta)
            stop_reason, stop_sequence = self._finish(delta)
        except ApiError as exc:
            return await end_stream(send, _event("error", anthropic_body(exc, self.rid)))
        except Exception:
            log.exception("request %s failed mid-stream", self.rid)
            error = ApiError(500, "internal server error")
            return await end_stream(send, _event("error", anthropic_body(error, self.rid)))
        end = {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}}
        end["usage"] = self._usage()
        stop = _BLOCK_STOP if self.tools is None else blocks.end()
        if thoughts is not None:
            stop = thoughts.end()
        await end_stream(send, stop + _event("message_delta", end) + _MESSAGE_STOP)

    def _delta_event(self, delta: RequestDelta) -> bytes:
        text = orjson.dumps(delta.new_text)
        if self.suffix is None:
            return _DELTA_PREFIX + text + _DELTA_SUFFIX
        return _DELTA_PREFIX + text + self.suffix + orjson.dumps(delta.new_token_ids) + b"}\n\n"

    def _count(self, delta: RequestDelta) -> None:
        self.output_tokens += len(delta.new_token_ids)
        self.cached = delta.cached_tokens

    def _finish(self, delta: RequestDelta) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the final delta; ApiError when it failed."""
        reason = delta.finish_reason
        if reason == "error":
            raise ApiError(500, f"generation failed: {delta.error}")
        if reason not in _STOP_REASONS:  # "abort"
            # Not the client's doing (it would not be listening): drain or engine trouble.
            raise ApiError(529, "the server cancelled this request (shutting down or overloaded)")
        if self.tools is not None and self.tools.calls:
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


def chat_turns(request: CountTokensRequest) -> tuple[list[dict[str, str]], str | None]:
    """Chat-template messages (system first, same-role turns merged) and the prefill, if any."""
    if not request.messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    turns: list[dict[str, str]] = []
    last = len(request.messages) - 1
    for i, message in enumerate(request.messages):
        text = _text(message.content)
        check_content(i, message.role, bool(text), last)
        if turns and turns[-1]["role"] == message.role:
            turns[-1]["content"] += "\n\n" + text
        else:
            turns.append({"role": message.role, "content": text})
    system = _text(request.system) if request.system is not None else ""
    return with_system_and_prefill(turns, system)


def _text(content: str | list[TextBlock]) -> str:
    if isinstance(content, str):
        return content
    return "".join(b.text for b in content if isinstance(b, TextBlock))


def _sampling_params(request: MessagesRequest, tools: list[Tool]) -> SamplingParams:
    grammar = forced_grammar(request, tools) or output_grammar(request)
    return sampling_params(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        max_tokens=request.max_tokens,
        stop=request.stop_sequences,
        grammar=grammar,
    )


def output_grammar(request: MessagesRequest) -> str | None:
    """The grammar of `output_config.format` (or the beta's `output_format`), or None."""
    config = request.output_config.format if request.output_config is not None else None
    if config is not None and request.output_format is not None:
        raise ApiError(
            400, "output_format: use output_config.format (output_format is deprecated), not both"
        )
    where = "output_config.format" if config is not None else "output_format"
    output_format = config or request.output_format
    if output_format is None:
        return None
    last = request.messages[-1] if request.messages else None
    if last is not None and last.role == "assistant" and _text(last.content):
        raise ApiError(
            400, f"{where}: structured outputs cannot continue a prefilled assistant message"
        )
    try:
        return json_schema_grammar(output_format.schema)
    except InvalidRequestError as exc:
        raise ApiError(400, f"{where}.schema: {exc}") from None


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (
        name.encode(),
        orjson.dumps({"type": name, **data}),
    )
