"""What every API surface shares: the engine, the tokenizer, the gateway and validation.

The gateway (keys, rate limits, budgets) sits between parsing a request and handing it to
the engine: `admit` is that place, and `generate` charges each step's tokens.

While the engine process restarts (see `zerohop.engine.process.supervisor`) a new request is refused
at once with Anthropic's 529, OpenAI's 503 or gRPC UNAVAILABLE and a `retry-after` of the
expected restart time; a request in flight when the engine died ends with the same error.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from zerohop.api.errors import ApiError, ErrorKind
from zerohop.api.http.asgi import (
    DEFAULT_BODY_DEADLINE,
    BodyDeadline,
)
from zerohop.api.http.keepalive import DEFAULT_OPENAI_PING_INTERVAL, DEFAULT_PING_INTERVAL
from zerohop.api.http.trusted_front import TrustedFront
from zerohop.api.load.overload import AdmissionControl
from zerohop.api.serving.model_names import ModelNames
from zerohop.api.serving.output_length import Api, output_limit
from zerohop.api.serving.shared_runs import SharedRuns
from zerohop.api.serving.thought_signatures import ThoughtSignatures
from zerohop.api.tools.parsers import ParserFactory, parser_for
from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.client import EngineClient, RequestOptions
from zerohop.engine.sample.sampling_params import SamplingParams
from zerohop.engine.sched.fair_share import BACKGROUND, BATCH, INTERACTIVE
from zerohop.engine.sched.request_options import check_weight
from zerohop.engine.text.tokenizer import Tokenizer
from zerohop.gateway.gateway import Call, Gateway, GatewayError

DEFAULT_MAX_BODY_BYTES = 32 * 2**20  # the Anthropic API's request size limit


def new_request_id(prefix: str = "req_") -> str:
    return prefix + os.urandom(12).hex()


def api_error(error: GatewayError) -> ApiError:
    """A gateway refusal as an API error, with the headers that tell clients when to retry."""
    headers: list[tuple[bytes, bytes]] = []
    if error.retry_after is not None:
        seconds = max(1, int(error.retry_after + 0.999))
        headers.append((b"retry-after", str(seconds).encode()))
        headers.append((b"retry-after-ms", str(int(error.retry_after * 1000) + 1).encode()))
    if error.should_retry is not None:
        headers.append((b"x-should-retry", b"true" if error.should_retry else b"false"))
    codes = {401: "invalid_api_key", 403: "model_not_allowed", 429: "rate_limit_exceeded"}
    code = error.code or codes.get(error.status)
    return ApiError(error.status, error.message, code=code, headers=headers)


def unavailable(
    surface: str, message: str, retry_after: float, kind: ErrorKind = ErrorKind.UNAVAILABLE
) -> ApiError:
    """Anthropic's 529 overloaded_error, OpenAI's 503 (gRPC: UNAVAILABLE), with retry-after:
    the official SDKs retry it, and zerohop.client tries another replica."""
    headers = [
        (b"retry-after", str(max(1, int(retry_after + 0.999))).encode()),
        (b"retry-after-ms", str(int(retry_after * 1000)).encode()),
        (b"x-should-retry", b"true"),
    ]
    status = 529 if surface == "anthropic" else 503
    return ApiError(status, message, code="unavailable", headers=headers, kind=kind)


def engine_options(call: Call, continues: list[int] | None = None) -> RequestOptions:
    """The scheduler's view of the caller: tenant, fair-share weight, priority class, and the
    tenant as the prefix cache's salt: as the Anthropic and OpenAI APIs keep prompt caches
    per organization, a tenant's prompts reuse its own cached blocks, never another's (whose
    timing would tell it what that tenant sent)."""
    identity = call.identity
    batch = identity.priority == "batch" or call.wants_batch  # a request can only lower it
    priority = BACKGROUND if call.background else BATCH if batch else INTERACTIVE
    tenant = identity.tenant
    return RequestOptions(
        tenant.name, tenant.weight, priority, tenant.name, continues=tuple(continues or ())
    )


def sampling_params(
    *,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    **fields: Any,
) -> SamplingParams:
    """SamplingParams from an API request: unset knobs take the APIs' defaults (temperature
    1, top_p 1, no top-k); a bad value is a 400."""
    try:
        return SamplingParams(
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=top_k or 0,
            **fields,
        )
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc)) from exc


@dataclass(slots=True)
class ServingContext:
    engine: EngineClient
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    draining: bool = False
    gateway: Gateway | None = None
    metrics_token: str | None = None  # /metrics needs this bearer token when set
    body_deadline: BodyDeadline = DEFAULT_BODY_DEADLINE
    max_header_bytes: int = 32 * 1024  # nginx's large_client_header_buffers: 4 x 8k
    trusted_front: TrustedFront = field(default_factory=TrustedFront)  # --trusted-front
    ping_interval: float = DEFAULT_PING_INTERVAL  # a stream's keep-alive (http/keepalive.py)
    openai_ping_interval: float = DEFAULT_OPENAI_PING_INTERVAL  # Chat and Completions streams
    runs: SharedRuns = field(default_factory=SharedRuns)  # identical requests attach to one
    admission: AdmissionControl | None = None  # overload refusals and load headers
    tool_call_parser: str | None = None  # --tool-call-parser; None or auto: by template
    max_batch_bytes: int = 256 * 2**20  # a Message Batches create body (the API's limit)
    max_file_bytes: int = 200 * 2**20  # an OpenAI batch input file (the API's limit)
    # Thinking blocks' signatures; by default a key of this process's own (server.py: the
    # key store's).
    thoughts: ThoughtSignatures = field(default_factory=ThoughtSignatures)
    # The names requests may use (served names, aliases); None: `model_name` alone.
    names: ModelNames = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.names is None:
            self.names = ModelNames((self.model_name,))
        self.model_name = self.names.primary

    @property
    def tool_parser(self) -> ParserFactory:
        """The format the model's tool calls are read in (tools/parsers.py)."""
        return parser_for(self.tokenizer.chat_template, self.tool_call_parser)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (token ids a prompt may hold), not the tokenizer's."""
        return int(self.engine.info["vocab_size"])

    @property
    def ready(self) -> bool:
        return not self.draining and self.engine.dead is None

    @property
    def alive(self) -> bool:
        """False once the engine cannot be restarted: /health fails, the process exits."""
        return getattr(self.engine, "gave_up", None) is None

    def not_ready_error(self, surface: str) -> ApiError:
        if self.draining:
            return unavailable(surface, "the server is shutting down; retry on another replica", 1)
        if not self.alive:
            message = "this replica's engine cannot be restarted; retry on another replica"
            return unavailable(surface, message, 1)
        message = "the engine is restarting; retry in a few seconds"
        return unavailable(surface, message, self.engine.retry_after())

    def lost_error(self, surface: str) -> ApiError:
        """The error of a request that was in flight when the engine process died."""
        message = "the engine stopped while serving this request and is restarting; retry it"
        return unavailable(surface, message, self.engine.retry_after(), kind=ErrorKind.ENGINE_DEAD)

    def load_headers(self, call: Call | None = None) -> list[tuple[bytes, bytes]]:
        """The replica's load; with `call`, its own predicted and actual queue wait."""
        if self.admission is None:
            return []
        timing = None if call is None else call.queue_timing
        return self.admission.load().headers() + ([] if timing is None else timing.headers())

    def check_model(self, name: str, call: Call | None = None) -> None:
        """404 model_not_found unless `name` is one the server answers to (model_names.py);
        then the caller's key must allow it, or allow the primary name (the same model)."""
        if not self.names.accepts(name):
            message = f"model: {name} (this server serves '{self.model_name}'"
            listed = [n for n in self.names.listed() if n != self.model_name]
            message += f", also as {', '.join(listed)})" if listed else ")"
            raise ApiError(404, message, param="model", code="model_not_found")
        if call is not None and self.gateway is not None:
            self.gateway.check_model(call, name, served=self.model_name)

    def allows(self, call: Call, name: str) -> bool:
        """Whether the caller's key may use `name` (listings show only those)."""
        identity = call.identity
        return identity.allows_model(name) or identity.allows_model(self.model_name)

    def encode_chat(self, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
        try:
            return self.tokenizer.encode_chat(messages, add_generation_prompt=True, **extra)
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc), param="messages") from exc

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def continued(self, prompt: list[int], continues: list[int] | None) -> list[int]:
        """The prompt followed by the partial answer a request continues (`continue_token_ids`,
        sent by zerohop.client when the replica that began the answer failed)."""
        if not continues:
            return prompt
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in continues):
            message = f"continue_token_ids: token ids must be in [0, {vocab})"
            raise ApiError(400, message, param="continue_token_ids")
        return prompt + continues

    def output_limit(self, api: Api, prompt_tokens: int, max_tokens: int | None) -> int | None:
        """The output tokens a request may produce in this model's context (None: up to it);
        one policy for every surface: `zerohop.api.serving.output_length`."""
        return output_limit(api, prompt_tokens, max_tokens, self.max_model_len)

    async def admit(
        self, call: Call, prompt: list[int], params: SamplingParams, options: RequestOptions
    ) -> SamplingParams:
        """Rate limits and budget: refuse, or admit with max_tokens clamped to the budget."""
        if not self.ready:
            raise self.not_ready_error(call.surface)
        try:  # the key store validates weights too; a bad one must never reach a division
            check_weight(options.weight)
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc), code="invalid_tenant_weight") from exc
        # Before the gateway: a refusal costs no quota. Batch lines skip it: the batch runner
        # bounds them itself, and an overload refusal would only put the line back.
        if self.admission is not None and not call.background:
            request = options.queued(len(prompt))
            try:
                load = self.admission.check(call.surface, request)
                call.queue_timing = self.admission.timing(load)
            except ApiError:
                call.decision = "overloaded"  # counted in zerohop_refusals, audited
                raise
        if self.gateway is None:
            return params
        wanted = params.max_tokens or max(1, self.max_model_len - len(prompt))
        # The budget reserves every choice's output; each choice gets its share of a clamp.
        n = params.n
        granted = await self.gateway.admit(call, len(prompt), wanted * n)
        if granted < wanted * n:
            return dataclasses.replace(params, max_tokens=max(1, granted // n))
        return params
