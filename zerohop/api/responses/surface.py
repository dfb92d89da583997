"""The OpenAI Responses API: `POST /v1/responses` (streamed or not, or in the background),
`GET` / `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`,
`POST /v1/responses/{id}/cancel` and `POST /v1/responses/input_tokens`.

A fourth surface over the conversation spine: items.py and tools.py map the request into a
`Conversation`, the planner decides the prompt and grammar, output.py turns the reader's
events into output items and the stream's events. Admission, charging and audit are the
gateway's (`ServingContext.generate`), as on every surface; streams start once the request is
admitted and carry an SSE comment `: ping` whenever nothing was written for
`--stream-ping-interval` seconds; an identical request of the same key attaches to the one
running (shared_runs.py).

Decisions where the API leaves room:
- `max_output_tokens` beyond the room the context leaves after the prompt is clamped to it
  (absent: all of that room). `truncation: "auto"` drops the oldest turns (from a user turn
  to the next) until the prompt leaves room for an answer; `disabled` (the default) makes a
  prompt that does not fit a 400.
- `reasoning.effort` "none" or "minimal" asks a reasoning model not to think; other efforts
  leave it to the model (no thinking budget is derived from them). `reasoning.summary`,
  `text.verbosity`, `include`, `top_logprobs`, `max_tool_calls`, `service_tier`,
  `prompt_cache_retention` and `safety_identifier` are accepted and do not change the output.
- `presence_penalty` and `frequency_penalty` (-2.0 to 2.0) are applied to sampling as on
  Chat Completions. `max_output_tokens` below the spec's minimum of 16 is served, not
  refused (a short answer is a request's own business).
- `completed_at` is set when the response completes; queued, running, incomplete, failed
  and cancelled responses have it null.
- `prompt_cache_key` is echoed and never salts the prefix cache: zerohop.client routes a
  request by it (the replica that served the key before holds the prefix).
- `instructions` and `tools` are not carried over by `previous_response_id` (as in the
  API): each request sends its own.
- A response that ends at `max_output_tokens` (or the context) is `incomplete` with
  `incomplete_details.reason` "max_output_tokens"; a failed generation mid-stream is
  `response.failed` with the error. Usage counts prefix-cache hits within `input_tokens`
  (`input_tokens_details.cached_tokens`), and thought tokens as `reasoning_tokens`.
- `background: true` answers at once with the `queued` response and runs it to the end on
  this replica (whether or not the client stays), keeping it as it goes, leased to this
  replica (leases.py: a replica that dies has its response failed within the lease);
  `GET` polls it and `cancel` stops it (on any replica sharing the store: the one running it
  sees the stored status at its next lease tick). `stream` with `background` streams as a
  foreground request does, and keeps it.
- zerohop.client's failover continues a stream on another replica (`continue_token_ids`) and
  names the id its caller holds (`continue_response_id`, accepted only with
  `continue_token_ids`, in the form `resp_...`): the response is that id, and kept under it.
  The id never replaces a kept response but a `failed` one of the same tenant (the stream
  that failed over, kept by its replica): the tenant's other responses are a 400 naming
  `continue_response_id`, before anything is generated; another tenant's id, which this
  tenant cannot see, is refused by the store when the answer is kept (the answer is sent and
  not kept, as when the store is unreachable).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from zerohop.api.conversation.planner import plan, prompt_ids
from zerohop.api.conversation.request import Conversation, Reasoning, Turn
from zerohop.api.errors import ApiError
from zerohop.api.generation.driver import Generation, GenerationRequest
from zerohop.api.generation.events import Admitted
from zerohop.api.generation.sse import send_stream
from zerohop.api.http.asgi import (
    Handler,
    Receive,
    Scope,
    Send,
    end_stream,
    read_json_body,
    request_id_headers,
    send_json,
    start_stream,
)
from zerohop.api.http.send_times import with_send_times
from zerohop.api.responses import compact
from zerohop.api.responses.formats import echoed_format, text_grammar
from zerohop.api.responses.items import as_items, input_turns
from zerohop.api.responses.listing import input_items_page, with_ids
from zerohop.api.responses.response_encoder import Prepared, ResponseEncoder
from zerohop.api.responses.schema import ResponsesRequest, decode_request
from zerohop.api.responses.stored import Found, StoredResponses, not_found
from zerohop.api.responses.tools import echoed_tools, request_tools, tool_choice
from zerohop.api.serving.service import ServingContext, sampling_params
from zerohop.api.serving.shared_runs import may_attach, run_key
from zerohop.gateway.gateway import Call

log = logging.getLogger(__name__)

BASE = "/v1/responses"
ONE = BASE + "/{response_id}"
RUNNING = ("queued", "in_progress")


def routes(
    ctx: ServingContext, stored: StoredResponses | None = None
) -> dict[tuple[str, str], Handler]:
    surface = ResponsesSurface(ctx, stored)
    return {
        ("POST", BASE): surface.create,
        ("POST", BASE + "/input_tokens"): surface.input_tokens,
        ("POST", BASE + "/compact"): surface.compact,
        ("GET", ONE): surface.retrieve,
        ("DELETE", ONE): surface.delete,
        ("GET", ONE + "/input_items"): surface.input_items,
        ("POST", ONE + "/cancel"): surface.cancel,
    }


class ResponsesSurface:
    """`store`: where responses are kept; None: none is (a `store: true` request is answered
    and forgotten, `background` is refused)."""

    def __init__(self, ctx: ServingContext, store: StoredResponses | None = None) -> None:
        self.ctx, self.store = ctx, store

    # -- create ----------------------------------------------------------------------------

    async def create(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        body = await self._body(scope, receive)
        request = decode_request(body)
        attach = may_attach(scope, request.temperature, request.seed)

        async def work(receive: Receive, send: Send) -> None:
            await self._create(request, scope, receive, send, call)

        await self.ctx.runs.serve(run_key(call, scope, body), attach, receive, send, work)

    async def _create(
        self, request: ResponsesRequest, scope: Scope, receive: Receive, send: Send, call: Call
    ) -> None:
        assert request.model is not None
        self.ctx.check_model(request.model, call)
        ready = await self._prepare(request, call)
        await self._claim(request, call)
        encoder = ResponseEncoder(ready, call, self._skeleton(ready, call))
        encoder.store = self.store if request.store else None
        if ready.summary is not None:
            return await self._compaction_only(encoder, send, request.stream)
        if request.background and not request.stream:
            return await self._background(encoder, send)
        generation = self._generation(encoder, receive, stream=request.stream)
        headers = request_id_headers(call.request_id)
        if request.stream:
            await send_stream(generation, encoder, with_send_times(scope, send), headers)
            await encoder.keep_failed()  # OpenAI keeps a stream that failed, as `failed`
        else:
            await encoder.whole(generation)
            await encoder.keep()
            await send_json(send, 200, encoder.body, headers)

    def _generation(
        self, encoder: ResponseEncoder, receive: Receive | None, stream: bool = False
    ) -> Generation:
        planned = encoder.ready.planned
        continues = encoder.ready.request.continue_token_ids or None
        wanted = GenerationRequest(
            "responses", planned.prompt, planned.params, planned.reader, continues
        )
        generation = Generation(self.ctx, encoder.call, wanted, receive, stream)
        encoder.usage = generation.usage  # a failure reports the usage so far
        if continues:
            encoder.resume(generation)
        return generation

    async def streamed(
        self,
        request: ResponsesRequest,
        send: Send,
        call: Call,
        receive: Receive,
        kept: Found | None,
        generate: bool = True,
    ) -> ResponseEncoder:
        """A streamed create whose previous response may be `kept` by the caller (a
        WebSocket's last response, store or not: websocket.py); its encoder, to keep.
        `generate` false: the request's state only, no output (a WebSocket client's warm-up)."""
        assert request.model is not None
        self.ctx.check_model(request.model, call)
        ready = await self._prepare(request, call, kept)
        await self._claim(request, call)
        encoder = ResponseEncoder(ready, call, self._skeleton(ready, call))
        encoder.store = self.store if request.store else None
        headers = request_id_headers(call.request_id)
        if ready.summary is not None:
            await self._compaction_only(encoder, send, True)
            return encoder
        if generate:
            generation = self._generation(encoder, receive, stream=True)
            await send_stream(generation, encoder, send, headers)
            await encoder.keep_failed()
            return encoder
        await start_stream(send, headers)
        opening = encoder.opening(Admitted(encoder.usage))
        encoder.body.update(status="completed", usage=encoder._usage())
        await end_stream(send, opening + await encoder.closing())
        return encoder

    async def _prepare(
        self, request: ResponsesRequest, call: Call, kept: Found | None = None, answer: bool = True
    ) -> Prepared:
        """`answer` false: the prompt only (counted or compacted), never compacted first."""
        inherited: list[Any] = []
        if request.previous_response_id is not None:
            found = kept or await self._found(
                call, request.previous_response_id, "previous_response_id"
            )
            inherited = [*found.items, *found.body.get("output", [])]
        given, trigger = compact.triggered(with_ids(as_items(request.input)))
        items = [*inherited, *given]
        tools = request_tools(request.tools)
        choice = tool_choice(request.tool_choice, request.parallel_tool_calls, tools)
        turns = input_turns(
            await compact.opened(self.ctx, call, items), request.instructions, tools
        )
        conv = Conversation(
            turns,
            tools=choice.tools,
            tool_choice=choice.choice,
            output_grammar=text_grammar(request.text.format if request.text else None),
            output_field="text.format",
            reasoning=_reasoning(request),
            raw_call=choice.raw_call,
            render_thoughts=True,  # the current tool loop's reasoning items (items.py)
        )
        if request.truncation == "auto":
            conv.turns = self._truncated(conv)
        params = sampling_params(
            temperature=request.temperature,
            top_p=request.top_p,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            max_tokens=request.max_output_tokens,
            seed=request.seed,
        )
        planned = plan(conv, self.ctx, params, request.continue_token_ids if answer else None)
        if trigger and answer:  # the compaction item is the whole response (compact.py)
            items, summary = await compact.compacted(self.ctx, call, items, conv)
            return Prepared(request, planned, items[:-1], tools, choice, conv, items[-1:], summary)
        limit = compact.threshold(request.context_management) if answer else None
        if limit is not None and len(planned.prompt) > limit:  # compact first (compact.py)
            items, _ = await compact.compacted(self.ctx, call, items, conv)
            opened = await compact.opened(self.ctx, call, items)
            conv.turns = input_turns(opened, request.instructions, tools)
            planned = plan(conv, self.ctx, params)
            return Prepared(request, planned, items[:-1], tools, choice, conv, items[-1:])
        return Prepared(request, planned, items, tools, choice, conv)

    async def _compaction_only(self, encoder: ResponseEncoder, send: Send, stream: bool) -> None:
        """A `compaction_trigger` request's response: its compaction item only (compact.py)."""
        summary, headers = encoder.ready.summary, request_id_headers(encoder.call.request_id)
        assert summary is not None
        compact.charge(encoder.call, summary)
        encoder.usage = summary.usage
        opening = encoder.opening(Admitted(summary.usage)) if stream else b""
        done = {"status": "completed", "completed_at": int(time.time())}
        encoder.body.update(done, output=encoder.items.items, usage=encoder._usage())
        if not stream:
            await encoder.keep()
            return await send_json(send, 200, encoder.body, headers)
        await start_stream(send, headers)
        await end_stream(send, opening + await encoder.closing())

    def _truncated(self, conv: Conversation) -> list[Turn]:
        """The turns, the oldest dropped (a user turn up to the next) until the prompt leaves
        room for an answer (`truncation: "auto"`)."""
        turns = conv.turns
        while len(prompt_ids(conv, self.ctx)) >= self.ctx.max_model_len - 1:
            starts = [i for i, t in enumerate(turns) if t.role == "user"]
            if len(starts) < 2:
                break  # the last user turn stays: the 400 says the prompt is too long
            turns = [t for t in turns[: starts[0]] if t.role == "system"] + turns[starts[1] :]
            conv = dataclasses.replace(conv, turns=turns)
        return turns

    def _skeleton(self, ready: Prepared, call: Call) -> dict[str, Any]:
        """The response object before any output (`status` in_progress)."""
        request = ready.request
        text = request.text
        fmt = echoed_format(text.format if text else None)
        effort = request.reasoning.effort if request.reasoning else None
        summary = request.reasoning.summary if request.reasoning else None
        return {
            "id": request.continue_response_id or "resp_" + call.request_id.removeprefix("req_"),
            "object": "response",
            "created_at": int(time.time()),
            "completed_at": None,  # set when it completes (response_encoder.py)
            "status": "in_progress",
            "background": request.background,
            "error": None,
            "incomplete_details": None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": request.max_tool_calls,
            "model": request.model,
            "output": [],
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "prompt_cache_key": request.prompt_cache_key,
            "reasoning": {"effort": effort, "summary": summary},
            "safety_identifier": request.safety_identifier,
            "service_tier": "default",
            "store": request.store,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": {"format": fmt, "verbosity": (text.verbosity if text else None) or "medium"},
            "tool_choice": request.tool_choice or "auto",
            "tools": echoed_tools(request.tools),
            "top_logprobs": request.top_logprobs or 0,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "presence_penalty": request.presence_penalty or 0.0,
            "frequency_penalty": request.frequency_penalty or 0.0,
            "truncation": request.truncation,
            "usage": None,
            "user": request.user,
            "metadata": request.metadata or {},
        }

    async def _background(self, encoder: ResponseEncoder, send: Send) -> None:
        """Answer with the queued response, then run it here to its end (module docstring)."""
        store, body, request_id = self.store, encoder.body, encoder.call.request_id
        body["status"] = "queued"
        if store is None or not await encoder.keep():
            raise ApiError(503, "background: the server could not keep the response now")
        await send_json(send, 200, body, request_id_headers(request_id))
        body["status"] = "in_progress"
        store.leases.track(body["id"], lambda: self.ctx.engine.abort(request_id))
        try:
            await encoder.whole(self._generation(encoder, None))
        except ApiError as exc:
            encoder.fail(exc)
        await store.finish(encoder.tenant, body)  # its lease released

    # -- the other routes ------------------------------------------------------------------

    async def retrieve(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        found = await self._found(call, scope["path_params"]["response_id"])
        await send_json(send, 200, found.body, request_id_headers(call.request_id))

    async def delete(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        response_id = scope["path_params"]["response_id"]
        await self._found(call, response_id)  # its tenant's, of a model the key may use
        assert self.store is not None
        if not await self.store.delete(call.identity.tenant.name, response_id):
            raise not_found(response_id)
        body = {"id": response_id, "object": "response", "deleted": True}
        await send_json(send, 200, body, request_id_headers(call.request_id))

    async def input_items(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        found = await self._found(call, scope["path_params"]["response_id"])
        page = input_items_page(found.items, scope.get("query_string", b""))
        await send_json(send, 200, page, request_id_headers(call.request_id))

    async def cancel(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        response_id = scope["path_params"]["response_id"]
        found = await self._found(call, response_id)
        body = found.body
        if not body.get("background"):
            raise ApiError(400, "Only responses created with background=true can be cancelled.")
        if found.status in RUNNING:
            body = {**body, "status": "cancelled"}
            assert self.store is not None
            await self.store.cancel(call.identity.tenant.name, response_id, body)
            self.store.leases.abort(response_id)  # here; elsewhere at its owner's next tick
        await send_json(send, 200, body, request_id_headers(call.request_id))

    async def input_tokens(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        request = decode_request(await self._body(scope, receive))
        assert request.model is not None
        self.ctx.check_model(request.model, call)
        ready = await self._prepare(request, call, answer=False)
        body = {"object": "response.input_tokens", "input_tokens": len(ready.planned.prompt)}
        await send_json(send, 200, body, request_id_headers(call.request_id))

    async def compact(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        """`POST /v1/responses/compact` (compact.py)."""
        request = decode_request(await self._body(scope, receive))
        assert request.model is not None
        self.ctx.check_model(request.model, call)
        ready = await self._prepare(request, call, answer=False)
        assert ready.conversation is not None
        conv = ready.conversation
        output, summary = await compact.compacted(self.ctx, call, ready.items, conv)
        body = compact.compaction_body(call, output, summary)
        await send_json(send, 200, body, request_id_headers(call.request_id))

    async def _claim(self, request: ResponsesRequest, call: Call) -> None:
        """A continuation's `continue_response_id` may be kept under: not one of the tenant's
        kept responses but a `failed` one (module docstring)."""
        wanted = request.continue_response_id
        if wanted is None or self.store is None or not request.store:
            return
        try:
            found = await self.store.get(call.identity.tenant.name, wanted, check=False)
        except ApiError as exc:
            if exc.status == 404:
                return
            raise
        if found.status != "failed":
            message = f"continue_response_id: the response {wanted} is kept already"
            raise ApiError(400, message, param="continue_response_id")

    async def _found(self, call: Call, response_id: str, param: str | None = None) -> Found:
        """The tenant's stored response; a key that may not use its model gets the 403."""
        if self.store is None:
            raise not_found(response_id, param)
        found = await self.store.get(call.identity.tenant.name, response_id, param)
        self.ctx.check_model(found.body["model"], call)
        return found

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        ctx = self.ctx
        return await read_json_body(scope, receive, ctx.max_body_bytes, ctx.body_deadline)


def _reasoning(request: ResponsesRequest) -> Reasoning:
    effort = request.reasoning.effort if request.reasoning else None
    return Reasoning(think=False if effort in ("none", "minimal") else None)
