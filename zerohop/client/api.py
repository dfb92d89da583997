"""zerohop.client's own small API, for callers who don't use an official SDK.

    with Client(["http://10.0.0.1:8000", "http://10.0.0.2:8000"], api_key="zh-...") as client:
        message = client.messages(model="m", max_tokens=64, messages=[...])    # a dict
        with client.stream_messages(model="m", max_tokens=64, messages=[...]) as stream:
            for event in stream: ...                                            # a dict each
        client.chat(...), client.completions(...)             # OpenAI shapes; stream_chat(...),
                                                              # stream_completions(...) stream
        for reply in client.generate(model="m", prompt="Hi", max_tokens=8): ...  # gRPC Generate

Bodies are the APIs' own JSON; answers are plain dicts. Streams (`Stream`, `AsyncStream`)
yield one dict per event (`generate`: one GenerateResponse per step); the request goes out
at the first item, and leaving the `with` block (or `close()`) closes the response, also
when it was left early. All of them choose replicas by prefix affinity and fail over,
mid-stream included; `generate` does the same over `grpc://` replicas with the gRPC
`Generate` call; a Messages `thread` continue goes to the replica holding the thread
(`pinning`). `stats()` is the pool's per-replica counters. `AsyncClient` is the same in
async (`async with`, `aclose()`, `async for`).

Making a client starts nothing and does no I/O: the pool it makes starts with the first
request, and closing the client closes that pool (a pool the caller passed stays open).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Generic, TypeVar, cast

import grpc
import httpx2
import orjson

from zerohop.client.affinity import AffinityPolicy, RoundRobinPolicy
from zerohop.client.failover import FailoverPolicy
from zerohop.client.health import grpc_channel
from zerohop.client.pool import ReplicaPool, Replicas, new_pool
from zerohop.client.surfaces import event_data, sse_events
from zerohop.client.transport import async_http_client
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

T = TypeVar("T")
Item = TypeVar("Item")

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


class AsyncStream(Generic[T]):
    """A streamed answer, item by item (`async for`); `async with` or `aclose()` closes it."""

    def __init__(self, items: AsyncGenerator[T, None]) -> None:
        self._items = items

    def __aiter__(self) -> AsyncStream[T]:
        return self

    async def __anext__(self) -> T:
        return await anext(self._items)

    async def aclose(self) -> None:
        await self._items.aclose()

    async def __aenter__(self) -> AsyncStream[T]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


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
        self.pool = pool or new_pool(replicas, affinity)
        self.policy = policy or FailoverPolicy()
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.api_key = api_key
        self.http = async_http_client(
            pool=self.pool, policy=self.policy, base_url="http://zerohop", headers=headers
        )

    async def messages(self, **body: Any) -> dict[str, Any]:
        return await self._post("messages", body)

    def stream_messages(self, **body: Any) -> AsyncStream[dict[str, Any]]:
        return AsyncStream(self._stream(PATHS["messages"], body))

    async def chat(self, **body: Any) -> dict[str, Any]:
        return await self._post("chat", body)

    def stream_chat(self, **body: Any) -> AsyncStream[dict[str, Any]]:
        return AsyncStream(self._stream(PATHS["chat"], body))

    async def completions(self, **body: Any) -> dict[str, Any]:
        return await self._post("completions", body)

    def stream_completions(self, **body: Any) -> AsyncStream[dict[str, Any]]:
        return AsyncStream(self._stream(PATHS["completions"], body))

    async def _post(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("stream"):
            raise TypeError(f"{kind}() returns the whole answer; stream_{kind}() streams it")
        response = await self.http.post(PATHS[kind], content=orjson.dumps(body))
        # A JSON object: each of these endpoints answers one (orjson.loads is typed Any).
        return cast(dict[str, Any], _json(response))

    async def _stream(
        self, path: str, body: dict[str, Any]
    ) -> AsyncGenerator[dict[str, Any], None]:
        body = {**body, "stream": True}
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

    def generate(self, **fields: Any) -> AsyncStream[pb.GenerateResponse]:
        """gRPC `Generate` on the pool's `grpc://` replicas: each step's reply, resumed on
        another replica (`continue_token_ids`) if the one answering fails mid-stream."""
        return AsyncStream(self._generate(fields))

    async def _generate(self, fields: dict[str, Any]) -> AsyncGenerator[pb.GenerateResponse, None]:
        request = pb.GenerateRequest(**fields)
        prompt = request.prompt or str(list(request.prompt_token_ids.ids) or request.messages)
        received: list[int] = []
        tried: set[str] = set()
        await self.pool.astart()
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
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
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
        """Close its connections, and the pool if it made it."""
        await self.http.aclose()
        if self.owns_pool:
            await self.pool.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class Stream(Generic[T]):
    """A streamed answer, item by item (`for`); `with` or `close()` closes it. The items
    are read on the pool's loop."""

    def __init__(self, pool: ReplicaPool, items: AsyncStream[T]) -> None:
        self._pool, self._items = pool, items
        self._started = False

    def __iter__(self) -> Stream[T]:
        return self

    def __next__(self) -> T:
        self._started = True
        step = _next(self._items)
        item = self._pool.run(step)
        if isinstance(item, _End):
            raise StopIteration
        return item

    def close(self) -> None:
        if self._started and self._pool.running:
            self._pool.run(self._items.aclose())

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Client:
    """The blocking counterpart of `AsyncClient`; its requests run on the pool's loop."""

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
        self.pool = pool or new_pool(replicas, affinity)
        self._async = AsyncClient(pool=self.pool, api_key=api_key, policy=policy)

    def messages(self, **body: Any) -> dict[str, Any]:
        return self.pool.run(self._async.messages(**body))

    def stream_messages(self, **body: Any) -> Stream[dict[str, Any]]:
        return Stream(self.pool, self._async.stream_messages(**body))

    def chat(self, **body: Any) -> dict[str, Any]:
        return self.pool.run(self._async.chat(**body))

    def stream_chat(self, **body: Any) -> Stream[dict[str, Any]]:
        return Stream(self.pool, self._async.stream_chat(**body))

    def completions(self, **body: Any) -> dict[str, Any]:
        return self.pool.run(self._async.completions(**body))

    def stream_completions(self, **body: Any) -> Stream[dict[str, Any]]:
        return Stream(self.pool, self._async.stream_completions(**body))

    def generate(self, **fields: Any) -> Stream[pb.GenerateResponse]:
        return Stream(self.pool, self._async.generate(**fields))

    def stats(self) -> dict[str, dict[str, Any]]:
        return self.pool.stats()

    def close(self) -> None:
        """Close its connections, and the pool if it made it."""
        if self.pool.running:
            self.pool.run(self._async.http.aclose())
        if self.owns_pool:
            self.pool.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _End:
    """What `_next` returns after a stream's last item."""


_END = _End()


async def _next(items: AsyncStream[Item]) -> Item | _End:
    return await anext(items, _END)


def _json(response: httpx2.Response) -> Any:
    body = orjson.loads(response.content) if response.content else None
    if response.status_code >= 400:
        raise ApiStatusError(response.status_code, body)
    return body
