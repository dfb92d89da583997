"""The OpenAI API surface: chat completions and legacy completions, as vLLM serves them.

Streams send one SSE chunk per engine step (one token, normally) the moment it arrives; each
content chunk is a per-request pre-encoded prefix + `orjson.dumps(text)` + suffix. The stream
starts once the request is admitted (the gateway and the engine accepted it: refusals before
that still get a real status), before the prefill: chat sends its first chunk then (role
`assistant`, empty content, as the OpenAI API begins), and an SSE comment `: ping` whenever
nothing was written for a while (http/keepalive.py; OpenAI clients
skip comments; `--openai-ping-interval`, 30 s: see keepalive.py), so a slow prefill never trips
a client's first-byte or idle timeout.
A stream requested with `zerohop-send-times: 1` carries the server's send time as an SSE comment
before each write's events (`: zerohop-sent <unix seconds>`; send_times.py).

Chat takes vLLM's `chat_template_kwargs` (e.g. {"enable_thinking": false}): extra variables
for the chat template's render, a JSON object whose keys may not replace the render's own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from zerohop.api.conversation.planner import plan
from zerohop.api.errors import ApiError
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
from zerohop.api.openai.choices import ChatAnswer, CompletionAnswer
from zerohop.api.openai.events_stream import EventChatStream
from zerohop.api.openai.output import LogprobFormatter
from zerohop.api.openai.output_format import completion_grammar
from zerohop.api.openai.schema import (
    ChatRequest,
    CompletionRequest,
    chat_max_tokens,
    check_chat,
    check_completion,
    completion_prompt,
    decode,
    sampling_params,
)
from zerohop.api.openai.stream import ChatStream, CompletionStream, Stream
from zerohop.api.openai.turns import conversation
from zerohop.api.serving.service import ServingContext
from zerohop.api.serving.shared_runs import may_attach, run_key
from zerohop.engine.text.tokenizer import SPECIAL_TOKEN_NAMES
from zerohop.gateway.gateway import Call

log = logging.getLogger(__name__)

T = TypeVar("T")

# Variables the render sets itself (zerohop.engine.text.tokenizer.apply_chat_template), or the
# template's globals: a kwarg with one of these names would change what the request says
# (its messages, its tools) or break the template, so it is refused.
RENDER_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "raise_exception"}
    | {"strftime_now", *(f"{name}_token" for name in SPECIAL_TOKEN_NAMES)}
    | {"self"}  # ServingContext.encode_chat's own parameter: **kwargs would collide
)


class TemplatedChatRequest(ChatRequest, kw_only=True):
    """A chat request with vLLM's `chat_template_kwargs`, which only this surface's chat
    render reads (msgspec refuses a value that is not a JSON object)."""

    chat_template_kwargs: dict[str, Any] | None = None


def template_kwargs(request: TemplatedChatRequest) -> dict[str, Any]:
    """The request's extra template variables; one naming a render variable is a 400."""
    kwargs = request.chat_template_kwargs or {}
    if taken := sorted(RENDER_VARIABLES.intersection(kwargs)):
        raise ApiError(
            400,
            f"chat_template_kwargs: {taken[0]!r} is set by the server's chat template render"
            " and cannot be passed as a template kwarg",
            param=f"chat_template_kwargs.{taken[0]}",
        )
    return kwargs


def routes(ctx: ServingContext) -> dict[tuple[str, str], Handler]:
    api = OpenAIApi(ctx)
    return {
        ("POST", "/v1/chat/completions"): api.chat,
        ("POST", "/v1/completions"): api.completions,
    }  # GET /v1/models: zerohop/api/serving/model_list.py


class OpenAIApi:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.logprob_formatter = LogprobFormatter(ctx.tokenizer)

    # -- shared request path ---------------------------------------------------------------

    async def _read(self, scope: Scope, receive: Receive, kind: type[T]) -> tuple[bytes, T]:
        ctx = self.ctx
        body = await read_json_body(scope, receive, ctx.max_body_bytes, ctx.body_deadline)
        return body, decode(body, kind)

    async def _shared(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        call: Call,
        body: bytes,
        request: Any,
        work: Callable[[Receive, Send], Awaitable[None]],
    ) -> None:
        """`work`, or the identical request of this key that runs (shared_runs.py): when
        the sampling is deterministic (temperature 0, a seed) or an SDK retries."""
        attach = may_attach(scope, request.temperature, request.seed)
        await self.ctx.runs.serve(run_key(call, scope, body), attach, receive, send, work)

    # -- chat completions ------------------------------------------------------------------

    async def chat(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        body, request = await self._read(scope, receive, TemplatedChatRequest)

        async def work(receive: Receive, send: Send) -> None:
            await self._chat(request, scope, receive, send, call)

        await self._shared(scope, receive, send, call, body, request, work)

    async def _chat(
        self,
        request: TemplatedChatRequest,
        scope: Scope,
        receive: Receive,
        send: Send,
        call: Call,
    ) -> None:
        request_id = call.request_id
        check_chat(request)
        kwargs = template_kwargs(request)
        self.ctx.check_model(request.model, call)
        continues = request.continue_token_ids
        conv = conversation(request, kwargs)
        max_tokens = chat_max_tokens(request)
        top = (request.top_logprobs or 0) if request.logprobs else None
        params = sampling_params(request, max_tokens, top, self.ctx.vocab_size, None)
        planned = plan(conv, self.ctx, params, continues)
        call.wants_batch = request.wants_batch
        readers = planned.readers()
        wanted = GenerationRequest("chat", planned.prompt, planned.params, readers, continues)
        generation = Generation(self.ctx, call, wanted, receive, stream=bool(request.stream))
        n, formatter = planned.params.n, self.logprob_formatter
        rid = "chatcmpl-" + request_id.removeprefix("req_")
        if request.stream:
            options = request.stream_options
            usage = bool(options and options.include_usage)
            kind = ChatStream if readers is None else EventChatStream
            stream = kind(request_id, rid, request.model, usage, formatter, n, top=top)
            stream.token_ids = bool(request.return_token_ids)
            await self._stream(generation, stream, scope, send)
        else:
            thinks = planned.in_thought is not None
            answer = ChatAnswer(n, top, formatter, thinks)
            await self._whole(generation, answer, rid, request.model, "chat.completion", send)

    # -- completions -----------------------------------------------------------------------

    async def completions(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        body, request = await self._read(scope, receive, CompletionRequest)

        async def work(receive: Receive, send: Send) -> None:
            await self._completions(request, scope, receive, send, call)

        await self._shared(scope, receive, send, call, body, request, work)

    async def _completions(
        self,
        request: CompletionRequest,
        scope: Scope,
        receive: Receive,
        send: Send,
        call: Call,
    ) -> None:
        request_id = call.request_id
        check_completion(request)
        self.ctx.check_model(request.model, call)
        given = completion_prompt(request, self.ctx.vocab_size)
        prompt = self.ctx.encode_text(given) if isinstance(given, str) else given
        continues = request.continue_token_ids
        prompt = self.ctx.continued(prompt, continues)
        grammar = completion_grammar(request)
        params = sampling_params(
            request, request.max_tokens, request.logprobs, self.ctx.vocab_size, grammar
        )
        echo = ""
        if request.echo:
            echo = given if isinstance(given, str) else self.ctx.tokenizer.decode(given)
        call.wants_batch = request.wants_batch
        wanted = GenerationRequest("completions", prompt, params, None, continues)
        generation = Generation(self.ctx, call, wanted, receive, stream=bool(request.stream))
        formatter = self.logprob_formatter
        rid = "cmpl-" + request_id.removeprefix("req_")
        if request.stream:
            options = request.stream_options
            usage = bool(options and options.include_usage)
            stream = CompletionStream(
                request_id, rid, request.model, usage, formatter, params.n, echo=echo
            )
            stream.token_ids = bool(request.return_token_ids)
            await self._stream(generation, stream, scope, send)
        else:
            answer = CompletionAnswer(params.n, echo, formatter)
            await self._whole(generation, answer, rid, request.model, "text_completion", send)

    # -- the response, streamed or whole ---------------------------------------------------

    async def _stream(
        self, generation: Generation, stream: Stream, scope: Scope, send: Send
    ) -> None:
        headers = request_id_headers(generation.call.request_id)
        await send_stream(generation, stream, with_send_times(scope, send), headers)

    async def _whole(
        self,
        generation: Generation,
        answer: ChatAnswer | CompletionAnswer,
        rid: str,
        model: str,
        kind: str,
        send: Send,
    ) -> None:
        async for step in generation.steps():
            answer.add(step)
        body = {
            "id": rid,
            "object": kind,
            "created": int(time.time()),
            "model": model,
            "choices": answer.body(),
            "usage": answer.usage_body(),
        }
        await send_json(send, 200, body, request_id_headers(generation.call.request_id))
