"""The gRPC surface: `zerohop.v1.Zerohop` (Generate, CountTokens), health and reflection.

grpc.aio on its own port (see DESIGN.md: ~70-140 µs per streamed message, so one message per
engine step carrying all of that step's tokens). Validation and limits are the shared ones in
ServingContext; ApiError statuses become gRPC status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from zerohop.api.conversation.events import (
    CallArguments,
    CallEnd,
    CallStart,
    Event,
    Text,
    Thought,
)
from zerohop.api.conversation.planner import Plan, plan
from zerohop.api.errors import ApiError, ErrorKind, error_kind
from zerohop.api.generation.driver import Generation, GenerationRequest
from zerohop.api.generation.events import Finish, FinishReason, Step
from zerohop.api.grpc.constraint import constraint_grammar
from zerohop.api.grpc.error_record import grpc_interceptors
from zerohop.api.grpc.front import front_headers
from zerohop.api.grpc.tools import call_id, conversation, refuse_tools, tool_call
from zerohop.api.http.rate_headers import openai_rate_headers
from zerohop.api.serving.service import ServingContext, api_error, new_request_id, sampling_params
from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.sample.sampling_params import SamplingParams
from zerohop.gateway.gateway import Call, Gateway, GatewayError
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Zerohop"].full_name  # "zerohop.v1.Zerohop"
HEALTH_POLL_SECONDS = 0.5

_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    529: grpc.StatusCode.UNAVAILABLE,
}
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.TOOL_CALLS: pb.FINISH_REASON_TOOL_CALLS,
}

PromptRequest = pb.GenerateRequest | pb.CountTokensRequest


class ZerohopServicer(pb_grpc.ZerohopServicer):
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        async with self._call(context) as call:
            await self._generate(request, context, call)

    async def CountTokens(
        self, request: pb.CountTokensRequest, context: grpc.aio.ServicerContext
    ) -> pb.CountTokensResponse:
        async with self._call(context) as call:
            self.ctx.check_model(request.model, call)
            if request.WhichOneof("input") == "messages":  # checked as Generate plans it
                prompt = self._plan(request, SamplingParams()).prompt
            else:
                prompt = self._prompt(request)
            return pb.CountTokensResponse(input_tokens=len(prompt))

    @contextlib.asynccontextmanager
    async def _call(self, context: grpc.aio.ServicerContext) -> AsyncIterator[Call]:
        """Authenticate the call, end it with the gRPC status for what went wrong, and
        hand it to the gateway's audit and metrics when it is over."""
        call = Call(
            await _start(context, self.ctx), "grpc", client=context.peer(), http_version="2"
        )
        front = self.ctx.trusted_front.end_user(*front_headers(context))
        call.end_user, call.end_user_email = front.user, front.email
        gateway = self.ctx.gateway
        status, error_type = 200, None
        try:
            if gateway is not None:
                gateway.authenticate(call, _metadata_key(context))
            yield call
        except GatewayError as exc:
            status, error_type = exc.status, exc.reason
            call.refusal = exc.message
            error = api_error(exc)
            context.set_trailing_metadata(_trailers(error, gateway, call, self.ctx))
            await context.abort(self._code(error), error.message)
        except (ApiError, InvalidRequestError) as exc:
            # InvalidRequestError: e.g. a tool's schema the call grammar cannot compile
            refused = exc if isinstance(exc, ApiError) else ApiError(400, str(exc))
            status, error_type = refused.status, error_kind(refused)
            call.refusal = refused.message  # kept where the request was refused (overload)
            context.set_trailing_metadata(_trailers(refused, None, call, self.ctx))
            await context.abort(self._code(refused), refused.message)
        except grpc.aio.AbortError:
            raise
        except asyncio.CancelledError:
            status, error_type = 499, ErrorKind.CLIENT_DISCONNECTED  # as on HTTP
            raise
        except Exception:
            status, error_type = 500, "internal"
            log.exception("gRPC request %s failed", call.request_id)
            message = f"internal error (request {call.request_id})"
            await context.abort(grpc.StatusCode.INTERNAL, message)
        finally:
            if gateway is not None:
                gateway.finish(call, status, error_type)

    async def _generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, call: Call
    ) -> None:
        ctx = self.ctx
        ctx.check_model(request.model, call)
        continues = list(request.continue_token_ids)
        params = _sampling_params(request, ctx.vocab_size)
        output = _Output()
        if request.WhichOneof("input") == "messages":
            # The constraint becomes the conversation's output format; the plan's grammar
            # replaces it in params (a forced call refuses it, strict tools stand aside).
            planned = self._plan(request, params, params.grammar, continues)
            wanted = GenerationRequest(
                "grpc", planned.prompt, planned.params, planned.readers(), continues
            )
        else:
            prompt = ctx.continued(self._prompt(request), continues)
            wanted = GenerationRequest("grpc", prompt, params, None, continues)
        # A cancelled or timed-out call raises CancelledError at one of these awaits;
        # closing the iterator then aborts the request in the engine.
        steps = Generation(ctx, call, wanted).steps()
        async with contextlib.aclosing(steps):
            async for step in steps:
                if step.token_ids or step.text or step.finish is not None:
                    await context.write(output.message(step))

    def _plan(
        self,
        request: PromptRequest,
        params: SamplingParams,
        grammar: str | None = None,
        continues: list[int] | None = None,
    ) -> Plan:
        """A `messages` request's engine request, by the planner every surface shares."""
        planned = plan(conversation(request, grammar), self.ctx, params, continues)
        _nonempty(planned.prompt, "messages")
        return planned

    def _prompt(self, request: PromptRequest) -> list[int]:
        """A `prompt` or `prompt_token_ids` request's tokens, as given (no chat template)."""
        refuse_tools(request)
        kind = request.WhichOneof("input")
        if kind == "prompt":
            ids = self.ctx.encode_text(request.prompt)
        elif kind == "prompt_token_ids":
            ids = list(request.prompt_token_ids.ids)
        else:
            raise ApiError(400, "one of prompt, prompt_token_ids or messages is required")
        _nonempty(ids, kind)
        return ids

    def _code(self, error: ApiError) -> grpc.StatusCode:
        if error.status >= 500 and self.ctx.engine.dead:
            return grpc.StatusCode.UNAVAILABLE
        return _STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL)


def _nonempty(ids: list[int], kind: str) -> None:
    if not ids:
        raise ApiError(400, "the prompt is empty: it needs at least one token", kind)


def _metadata_key(context: grpc.aio.ServicerContext) -> str | None:
    """The key from `x-api-key` or `authorization: Bearer ...` metadata."""
    metadata = dict(context.invocation_metadata() or ())
    if key := metadata.get("x-api-key"):
        return str(key)
    scheme, _, token = (metadata.get("authorization") or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _trailers(
    error: ApiError, gateway: Gateway | None, call: Call, ctx: ServingContext
) -> list[tuple[str, str]]:
    """The refusal's retry facts, the caller's rate-limit state and the replica's load at the
    refusal, as trailing metadata. The load goes here as well as in the initial metadata: a
    call answered with nothing but an error may reach the client as Trailers-Only, without
    the initial metadata the server sent."""
    pairs = [(k.decode(), v.decode()) for k, v in error.headers or ()]
    pairs += [(k.decode(), v.decode()) for k, v in ctx.load_headers()]
    if gateway is not None:
        pairs += [(k.decode(), v.decode()) for k, v in openai_rate_headers(gateway, call)]
    return pairs


async def _start(context: grpc.aio.ServicerContext, ctx: ServingContext) -> str:
    """A request id for the call, sent at once as `request-id` metadata (for the logs), with
    the replica's load (`zerohop-queue-wait-ms`, ...)."""
    request_id = new_request_id()
    load = [(k.decode(), v.decode()) for k, v in ctx.load_headers()]
    await context.send_initial_metadata((("request-id", request_id), *load))
    return request_id


def _sampling_params(request: pb.GenerateRequest, vocab_size: int) -> SamplingParams:
    def given(name: str, default: float | None = None) -> float | None:
        return getattr(request, name) if request.HasField(name) else default

    return sampling_params(
        temperature=given("temperature"),
        top_p=given("top_p"),
        top_k=request.top_k,
        seed=given("seed"),
        max_tokens=given("max_tokens"),
        stop=list(request.stop),
        stop_token_ids=list(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
        logprobs=given("logprobs"),
        presence_penalty=given("presence_penalty", 0.0),
        frequency_penalty=given("frequency_penalty", 0.0),
        repetition_penalty=given("repetition_penalty", 1.0),
        min_p=given("min_p", 0.0),
        min_tokens=request.min_tokens,
        logit_bias=_logit_bias(request, vocab_size),
        grammar=constraint_grammar(request),
    )


def _logit_bias(request: pb.GenerateRequest, vocab_size: int) -> dict[int, float] | None:
    bias = dict(request.logit_bias)
    if bad := [token for token in bias if token >= vocab_size]:
        raise ApiError(
            400,
            f"logit_bias: {bad[0]} is not a token id of this model (0 to {vocab_size - 1})",
            "logit_bias",
        )
    return bias or None


class _Output:
    """A step as a GenerateResponse: its tokens and logprobs, its thought, its text without
    calls, a streamed call's deltas, the calls it completed, and the finish with the usage."""

    def __init__(self) -> None:
        self.ids: dict[int, str] = {}  # a streamed call's id, by its index

    def message(self, step: Step) -> pb.GenerateResponse:
        events = step.output
        message = pb.GenerateResponse(token_ids=step.token_ids)
        message.text = "".join(e.text for e in events if isinstance(e, Text))
        message.thought = "".join(e.text for e in events if isinstance(e, Thought))
        if step.logprobs is not None:
            message.logprobs.extend(
                _logprobs(token, top)
                for token, top in zip(step.token_ids, step.logprobs, strict=True)
            )
        for event in events:
            self._call_event(message, event)
        if step.finish is not None:
            _finish(message, step.finish)
        return message

    def _call_event(self, message: pb.GenerateResponse, event: Event) -> None:
        if isinstance(event, CallStart):
            self.ids[event.index] = call_id()
            message.tool_call_deltas.add(
                index=event.index, id=self.ids[event.index], name=event.name
            )
        elif isinstance(event, CallArguments):
            message.tool_call_deltas.add(index=event.index, arguments_json_fragment=event.fragment)
        elif isinstance(event, CallEnd):
            message.tool_calls.append(tool_call(event.call, self.ids.get(event.index)))


def _finish(message: pb.GenerateResponse, finish: Finish) -> None:
    message.finish_reason = _FINISH_REASONS[finish.reason]
    if isinstance(finish.stop, str):
        message.stop_string = finish.stop
    elif isinstance(finish.stop, int):
        message.stop_token_id = finish.stop
    message.usage.prompt_tokens = finish.usage.prompt_tokens
    message.usage.completion_tokens = finish.usage.output_tokens
    message.usage.cached_tokens = finish.usage.cached_tokens


def _logprobs(token: int, top: dict[int, float]) -> pb.Logprobs:
    ranked = sorted(top.items(), key=lambda item: -item[1])
    return pb.Logprobs(
        logprob=top[token], top=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in ranked]
    )


class ReadinessHealth(health_aio.HealthServicer):
    """grpc.health.v1: SERVING while the context is ready, NOT_SERVING otherwise."""

    def __init__(self, ctx: ServingContext, services: Sequence[str]) -> None:
        super().__init__()
        self.ctx = ctx
        self.services = ("", *services)
        self._follower: asyncio.Task[None] | None = None

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in self.services:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service}")
        return health_pb2.HealthCheckResponse(status=self._status())

    def _status(self) -> health_pb2.HealthCheckResponse.ServingStatus:
        return _SERVING if self.ctx.ready else _NOT_SERVING

    def follow(self) -> None:
        """Keep Watch streams current; Check always reads the context directly."""
        self._follower = asyncio.create_task(self._follow())

    async def _follow(self) -> None:
        last = None
        while not self.ctx.draining:
            if (status := self._status()) != last:
                for service in self.services:
                    await self.set(service, status)
                last = status
            await asyncio.sleep(HEALTH_POLL_SECONDS)
        await self.enter_graceful_shutdown()


class GrpcDrain:
    """SIGTERM for the gRPC server, as uvicorn drains HTTP: no new calls from the first
    signal on, the calls in flight get `grace` seconds to finish (--drain-seconds), and a
    second signal ends them at once. HTTP and gRPC drain side by side, not one after the
    other."""

    def __init__(self, server: grpc.aio.Server, grace: float) -> None:
        self.server = server
        self.grace = grace
        self._stops: list[asyncio.Future[None]] = []

    def begin(self, now: bool = False) -> None:
        # grpc.aio allows a second stop during the first: the smaller grace wins.
        self._stops.append(asyncio.ensure_future(self.server.stop(None if now else self.grace)))

    async def finish(self) -> None:
        """Wait until the server has stopped (stopping it now if no signal began it)."""
        if not self._stops:
            self.begin()
        await asyncio.gather(*self._stops)


# Keepalive enforcement: a client may ping at most every 5 minutes without calls in
# flight (gRPC's default policy, made explicit), and is sent GOAWAY after 2 strikes; idle
# connections are closed after 10 minutes.
_PROTECTION_OPTIONS = [
    ("grpc.http2.min_ping_interval_without_data_ms", 300_000),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.max_connection_idle_ms", 600_000),
]


async def start_grpc_server(
    ctx: ServingContext, host: str, port: int, max_concurrent_streams: int = 100
) -> tuple[grpc.aio.Server, int]:
    """Start serving on host:port (port 0: any free port) and return the started server (stop
    it with `.stop()`) and the port it bound."""
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),  # else a second server can silently share the port
            ("grpc.max_receive_message_length", ctx.max_body_bytes),
            ("grpc.max_concurrent_streams", max_concurrent_streams),  # per connection
            *_PROTECTION_OPTIONS,
        ],
        compression=grpc.Compression.NoCompression,
        interceptors=grpc_interceptors(),  # none, unless ZEROHOP_ERROR_RECORD is set
    )
    pb_grpc.add_ZerohopServicer_to_server(ZerohopServicer(ctx), server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    health = ReadinessHealth(ctx, [SERVICE_NAME, health_name])
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health_name, reflection.SERVICE_NAME], server
    )
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)  # grpcio raises, older ones return 0
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise RuntimeError(f"gRPC: cannot listen on {address} (in use, or not this host's)")
    await server.start()
    health.follow()
    return server, bound
