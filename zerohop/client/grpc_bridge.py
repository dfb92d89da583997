"""`grpc://` replicas behind the httpx transports: an SDK's Anthropic or OpenAI request is
sent as a gRPC `Generate` call, and the answer comes back as the HTTP API's own JSON or SSE
stream (token ids included, so failover can resume it). The SDK user changes nothing.

gRPC status codes become the HTTP statuses the APIs use (UNAVAILABLE: 529/503 with the
replica's retry-after, RESOURCE_EXHAUSTED: 429, ...), so failover treats both kinds of
replica alike; a call that breaks after its first message reads as a broken stream.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx2
import orjson

from zerohop.client.failover import AsyncUpstream, RawBytes
from zerohop.client.health import grpc_channel
from zerohop.client.replica import Replica
from zerohop.client.surfaces import Completions, Messages, sse_event, surface_kind, text_of
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


class GrpcBridge(AsyncUpstream):
    """One channel per replica, in the event loop that uses it."""

    def __init__(self) -> None:
        self.channels: dict[str, grpc.aio.Channel] = {}

    async def open(self, replica: Replica, request: httpx2.Request, body: bytes) -> httpx2.Response:
        kind = surface_kind(request.url.path)
        if kind is None or request.method != "POST":
            path = request.url.path
            raise httpx2.ConnectError(f"{replica.url} is a gRPC replica: {path} has no gRPC form")
        payload = orjson.loads(body)
        render = _Render(issubclass(kind, Messages), issubclass(kind, Completions), payload)
        stub = pb_grpc.ZerohopStub(self._channel(replica.url))
        call = stub.Generate(generate_request(payload, render), metadata=_metadata(request))
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            return _error_response(exc, render)
        except grpc.RpcError as exc:  # a channel that cannot connect at all
            raise httpx2.ConnectError(f"{replica.url}: {exc}") from exc
        headers = [(k, v) for k, v in (await call.initial_metadata() or ()) if isinstance(v, str)]
        if not payload.get("stream"):
            replies = [first] + [r async for r in _rest(call)]
            return _json_response(200, headers, render.whole(replies))
        stream = _Stream(render.stream(first, _rest(call)), call)
        return httpx2.Response(
            200, headers=[*headers, ("content-type", "text/event-stream")], stream=stream
        )

    def _channel(self, url: str) -> grpc.aio.Channel:
        channel = self.channels.get(url)
        if channel is None:
            channel = self.channels[url] = grpc_channel(url)
        return channel

    async def aclose(self) -> None:
        for channel in self.channels.values():
            await channel.close()
        self.channels.clear()


def generate_request(payload: dict[str, Any], render: _Render) -> pb.GenerateRequest:
    request = pb.GenerateRequest(model=str(payload.get("model", "")))
    if render.anthropic or "messages" in payload:
        for role, text in _messages(payload):
            request.messages.messages.add(role=role, content=text)
    elif isinstance(payload.get("prompt"), list):
        request.prompt_token_ids.ids.extend(payload["prompt"])
    else:
        request.prompt = str(payload.get("prompt", ""))
    limit = payload.get("max_completion_tokens") or payload.get("max_tokens")
    if limit is None and render.completions:
        limit = 16
    if limit is not None:
        request.max_tokens = int(limit)
    for name in ("temperature", "top_p", "seed"):
        if payload.get(name) is not None:
            setattr(request, name, payload[name])
    request.top_k = int(payload.get("top_k") or 0)
    stop = payload.get("stop_sequences") or payload.get("stop") or []
    request.stop.extend([stop] if isinstance(stop, str) else stop)
    request.stop_token_ids.extend(payload.get("stop_token_ids") or [])
    request.ignore_eos = bool(payload.get("ignore_eos"))
    request.continue_token_ids.extend(payload.get("continue_token_ids") or [])
    return request


def _messages(payload: dict[str, Any]) -> list[tuple[str, str]]:
    turns = []
    if system := payload.get("system"):
        turns.append(("system", text_of(system)))
    for message in payload.get("messages") or []:
        turns.append((message.get("role", "user"), text_of(message.get("content"))))
    return turns


def _metadata(request: httpx2.Request) -> list[tuple[str, str]]:
    headers = request.headers
    pairs = [(k, headers[k]) for k in ("x-api-key", "authorization") if k in headers]
    return pairs


async def _rest(call: grpc.aio.UnaryStreamCall) -> AsyncIterator[pb.GenerateResponse]:
    try:
        while (reply := await call.read()) is not grpc.aio.EOF:
            yield reply
    except grpc.aio.AioRpcError as exc:
        raise httpx2.ReadError(f"the gRPC stream broke: {exc.code().name}") from exc


def _error_response(error: grpc.aio.AioRpcError, render: _Render) -> httpx2.Response:
    trailers = [(k, v) for k, v in (error.trailing_metadata() or ()) if isinstance(v, str)]
    status = _STATUS.get(error.code(), 500)
    if error.code() == grpc.StatusCode.UNAVAILABLE:
        status = 529 if render.anthropic else 503
    return _json_response(status, trailers, render.error(status, error.details()))


def _json_response(
    status: int, headers: list[tuple[str, str]], body: dict[str, Any]
) -> httpx2.Response:
    headers = [*headers, ("content-type", "application/json")]
    return httpx2.Response(status, headers=headers, stream=RawBytes(orjson.dumps(body)))


class _Stream(httpx2.AsyncByteStream):
    def __init__(self, events: AsyncIterator[bytes], call: grpc.aio.UnaryStreamCall) -> None:
        self.events, self.call = events, call

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for event in self.events:
            yield event

    async def aclose(self) -> None:
        self.call.cancel()


class _Render:
    """GenerateResponses as one of the HTTP APIs' answers."""

    def __init__(self, anthropic: bool, completions: bool, payload: dict[str, Any]) -> None:
        self.anthropic, self.completions, self.payload = anthropic, completions, payload
        self.model = payload.get("model", "")
        self.id = os.urandom(12).hex()
        self.created = int(time.time())

    async def stream(
        self, first: pb.GenerateResponse, rest: AsyncIterator[pb.GenerateResponse]
    ) -> AsyncIterator[bytes]:
        yield self.opening()
        reply = first
        while True:
            if reply.token_ids or reply.text or reply.thought:
                yield self.piece(list(reply.token_ids), reply.text, reply.thought)
            if reply.finish_reason:
                yield self.closing(reply)
                return
            following = await anext(rest, None)
            if following is None:
                raise httpx2.ReadError("the gRPC stream ended before the answer did")
            reply = following

    def opening(self) -> bytes:
        if self.anthropic:
            message = {
                "id": "msg_" + self.id,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0},
            }
            block = {"index": 0, "content_block": {"type": "text", "text": ""}}
            return (
                sse_event("message_start", {"message": message})
                + sse_event("content_block_start", block)
                + sse_event("ping", {})
            )
        if self.completions:
            return b""
        return self._chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})

    def piece(self, ids: list[int], text: str, thought: str = "") -> bytes:
        """A step's text; its thought (a reasoning model's) only on Chat, as `reasoning_content`:
        an Anthropic thinking block needs the replica's signature, which gRPC does not carry."""
        if self.anthropic:
            delta = {"index": 0, "delta": {"type": "text_delta", "text": text}, "token_ids": ids}
            return sse_event("content_block_delta", delta)
        if self.completions:
            body: dict[str, Any] = {"text": text}
        else:
            body = {"delta": {"content": text, **_reasoning(thought)}}
        return self._chunk({**body, "finish_reason": None, "token_ids": ids})

    def closing(self, last: pb.GenerateResponse) -> bytes:
        reason = _FINISH.get(last.finish_reason, "stop")
        stop = last.stop_string if last.WhichOneof("stop_reason") == "stop_string" else None
        if self.anthropic:
            delta = {"stop_reason": self._anthropic_reason(reason, stop), "stop_sequence": stop}
            end = {"delta": delta, "usage": self._anthropic_usage(last.usage)}
            stop_block = sse_event("content_block_stop", {"index": 0})
            return stop_block + sse_event("message_delta", end) + sse_event("message_stop", {})
        body: dict[str, Any] = {"text": ""} if self.completions else {"delta": {}}
        data = self._chunk({**body, "finish_reason": reason, "stop_reason": stop})
        options = self.payload.get("stream_options") or {}
        if options.get("include_usage"):
            usage = self._openai_usage(last.usage)
            data += b"data: " + orjson.dumps({**self._head(), "choices": [], "usage": usage})
            data += b"\n\n"
        return data + b"data: [DONE]\n\n"

    def whole(self, replies: list[pb.GenerateResponse]) -> dict[str, Any]:
        text = "".join(r.text for r in replies)
        thought = "".join(r.thought for r in replies)
        last = replies[-1]
        reason = _FINISH.get(last.finish_reason, "stop")
        stop = last.stop_string if last.WhichOneof("stop_reason") == "stop_string" else None
        if self.anthropic:
            return {
                "id": "msg_" + self.id,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [{"type": "text", "text": text}],
                "stop_reason": self._anthropic_reason(reason, stop),
                "stop_sequence": stop,
                "usage": self._anthropic_usage(last.usage),
            }
        if self.completions:
            choice = {"index": 0, "text": text, "logprobs": None}
        else:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, **_reasoning(thought)},
                "logprobs": None,
            }
        choice |= {"finish_reason": reason, "stop_reason": stop}
        return {
            **self._head(),
            "object": self._object(False),
            "choices": [choice],
            "usage": self._openai_usage(last.usage),
        }

    def error(self, status: int, message: str) -> dict[str, Any]:
        if self.anthropic:
            kind = {
                400: "invalid_request_error",
                401: "authentication_error",
                403: "permission_error",
                404: "not_found_error",
                429: "rate_limit_error",
                529: "overloaded_error",
            }.get(status, "api_error")
            return {"type": "error", "error": {"type": kind, "message": message}}
        kind = "invalid_request_error" if status < 500 else "server_error"
        return {"error": {"message": message, "type": kind, "param": None, "code": None}}

    def _anthropic_reason(self, reason: str, stop: str | None) -> str:
        if stop is not None:
            return "stop_sequence"
        return "max_tokens" if reason == "length" else "end_turn"

    def _anthropic_usage(self, usage: pb.Usage) -> dict[str, int]:
        return {
            "input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens,
        }

    def _openai_usage(self, usage: pb.Usage) -> dict[str, Any]:
        return {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        }

    def _object(self, chunk: bool) -> str:
        if self.completions:
            return "text_completion"
        return "chat.completion.chunk" if chunk else "chat.completion"

    def _head(self) -> dict[str, Any]:
        prefix = "cmpl-" if self.completions else "chatcmpl-"
        return {
            "id": prefix + self.id,
            "object": self._object(True),
            "created": self.created,
            "model": self.model,
        }

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        body = {**self._head(), "choices": [{"index": 0, "logprobs": None, **choice}]}
        return b"data: " + orjson.dumps(body) + b"\n\n"


def _reasoning(thought: str) -> dict[str, str]:
    """Chat's thought fields (vLLM's two names), when there is one."""
    return {"reasoning_content": thought, "reasoning": thought} if thought else {}
