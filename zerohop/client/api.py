"""zerohop.client's own small API, for callers who don't use an official SDK.

    client = Client(["http://10.0.0.1:8000", "http://10.0.0.2:8000"], api_key="zh-...")
    message = client.messages(model="m", max_tokens=64, messages=[...])        # a dict
    for event in client.messages(model="m", max_tokens=64, messages=[...], stream=True): ...
    client.chat(...), client.completions(...)                                  # OpenAI shapes
    for reply in client.generate(model="m", prompt="Hi", max_tokens=8): ...    # gRPC Generate

Bodies are the APIs' own JSON; answers are plain dicts (streams: one dict per event). All
of them choose replicas by prefix affinity and fail over, mid-stream included; `generate`
does the same over `grpc://` replicas with the gRPC `Generate` call. `stats()` is the pool's
per-replica counters. `AsyncClient` is the same in async.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import httpx2
import orjson

from zerohop.api.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.api.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc
from zerohop.client.affinity import AffinityPolicy, RoundRobinPolicy
from zerohop.client.failover import FailoverPolicy
from zerohop.client.health import grpc_channel
from zerohop.client.pool import ReplicaPool, Replicas
from zerohop.client.surfaces import event_data, sse_events
from zerohop.client.transport import async_http_client

PATHS = {
    "messages": "/v1/messages",
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
}


class ApiStatusError(Exception):
    """A replica answered with an error (after failover had nowhere better to go)."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"{status}: {body}")
        self.status, self.body = status, body


class AsyncClient:
    def __init__(
        self,
        replicas: Replicas | None = None,
        *,
        api_key: str | None = None,
        pool: ReplicaPool | None = None,
        policy: FailoverPolicy | None = None,
        affinity: AffinityPolicy | RoundRobinPolicy | None = None,
    ) -> None:
        self.owns_pool = pool is None
        self.pool = pool or ReplicaPool(replicas, affinity=affinity)
        self.policy = policy or FailoverPolicy()
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.api_key = api_key
        self.http = async_http_client(
            pool=self.pool, policy=self.policy, base_url="http://zerohop", headers=headers
        )

    async def messages(self, **body: Any) -> Any:
        return await self._post("messages", body)

    async def chat(self, **body: Any) -> Any:
        return await self._post("chat", body)

    async def completions(self, **body: Any) -> Any:
        return await self._post("completions", body)

    async def _post(self, kind: str, body: dict[str, Any]) -> Any:
        if body.get("stream"):
            return self._stream(PATHS[kind], body)
        response = await self.http.post(PATHS[kind], content=orjson.dumps(body))
        return _json(response)

    async def _stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        request = self.http.build_request("POST", path, content=orjson.dumps(body))
        response = await self.http.send(request, stream=True)
        try:
            if response.status_code != 200:
                await response.aread()
                _json(response)
            async for event in sse_events(response.aiter_raw()):
                data = event_data(event)
                if data is not None and data != b"[DONE]":
                    yield orjson.loads(data)
        finally:
            await response.aclose()

    async def generate(self, **fields: Any) -> AsyncIterator[pb.GenerateResponse]:
        """gRPC `Generate` on the pool's `grpc://` replicas: each step's reply, resumed on
        another replica (`continue_token_ids`) if the one answering fails mid-stream."""
        request = pb.GenerateRequest(**fields)
        prompt = request.prompt or str(list(request.prompt_token_ids.ids) or request.messages)
        received: list[int] = []
        tried: set[str] = set()
        for _ in range(self.policy.max_attempts):
            replica, _ = self.pool.choose(prompt, tried | self._http_replicas())
            base = len(received)  # tokens the caller has from replicas before this one
            failed = False
            try:
                async for reply in self._generate_on(replica.url, request, received):
                    received.extend(reply.token_ids)
                    if reply.finish_reason and base:  # usage counts each token once
                        reply.usage.completion_tokens += base
                        reply.usage.prompt_tokens -= base
                    yield reply
                    if reply.finish_reason:
                        return
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL):
                    raise
                tried.add(replica.url)
                failed = True
                self.pool.failed(replica, trip_breaker=True, resumed=bool(received))
            finally:
                if not failed:
                    self.pool.release(replica)
        raise ApiStatusError(503, "every gRPC replica tried failed")

    async def _generate_on(
        self, url: str, request: pb.GenerateRequest, received: list[int]
    ) -> AsyncIterator[pb.GenerateResponse]:
        continued = pb.GenerateRequest()
        continued.CopyFrom(request)
        if received:
            continued.continue_token_ids.extend(received)
            if request.HasField("max_tokens"):
                continued.max_tokens = request.max_tokens - len(received)
        metadata = [("authorization", f"Bearer {self.api_key}")] if self.api_key else []
        async with grpc_channel(url) as channel:
            stub = pb_grpc.ZerohopStub(channel)
            async for reply in stub.Generate(continued, metadata=metadata):
                yield reply

    def _http_replicas(self) -> set[str]:
        return {url for url in self.pool.replicas if not url.startswith("grpc")}

    def stats(self) -> dict[str, dict[str, Any]]:
        return self.pool.stats()

    async def aclose(self) -> None:
        await self.http.aclose()
        if self.owns_pool:
            self.pool.close()


class Client:
    """The blocking counterpart of `AsyncClient`; its requests run on the pool's loop."""

    def __init__(self, replicas: Replicas | None = None, **options: Any) -> None:
        pool = options.pop("pool", None) or ReplicaPool(
            replicas, affinity=options.pop("affinity", None)
        )
        self.pool = pool
        self._async = pool.run(_make_async(pool, options))

    def messages(self, **body: Any) -> Any:
        return self._call(self._async.messages(**body), body)

    def chat(self, **body: Any) -> Any:
        return self._call(self._async.chat(**body), body)

    def completions(self, **body: Any) -> Any:
        return self._call(self._async.completions(**body), body)

    def generate(self, **fields: Any) -> Iterator[pb.GenerateResponse]:
        return self._iterate(self._async.generate(**fields))

    def stats(self) -> dict[str, dict[str, Any]]:
        return self.pool.stats()

    def close(self) -> None:
        self.pool.run(self._async.http.aclose())
        self.pool.close()

    def _call(self, coroutine: Any, body: dict[str, Any]) -> Any:
        result = self.pool.run(coroutine)
        return self._iterate(result) if body.get("stream") else result

    def _iterate(self, events: AsyncIterator[Any]) -> Iterator[Any]:
        while (item := self.pool.run(_next(events))) is not _END:
            yield item


_END = object()


async def _next(events: AsyncIterator[Any]) -> Any:
    return await anext(events, _END)


async def _make_async(pool: ReplicaPool, options: dict[str, Any]) -> AsyncClient:
    return AsyncClient(pool=pool, **options)  # made on the pool's loop, which will run it


def _json(response: httpx2.Response) -> Any:
    body = orjson.loads(response.content) if response.content else None
    if response.status_code >= 400:
        raise ApiStatusError(response.status_code, body)
    return body
