"""Sending one request to the pool: choose a replica, fail over, resume streams mid-way.

Before the first byte of an answer, a connect error, a reset, a 5xx (529 and 503 included)
or a 429 with `retry-after` moves the request to the next replica at once, up to
`max_attempts` replicas and `deadline` seconds; when every try failed, the caller gets the
last replica's answer (the SDKs then apply their own retry policy) or the last error.

After the first byte, a stream that breaks (reset, early end, an overload or server error
event) continues on another replica from the token ids the caller already has (see
`surfaces`), and the caller's stream goes on as if nothing happened.

A request that builds on a thread or a stored response goes to the replica that answered
that id, whose ids are learned from the answers as they pass (`pinning`), the continuing
replica's included: it keeps the answer under the id the caller holds (`surfaces`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx2
import orjson

from zerohop.client import pinning
from zerohop.client.pool import ReplicaPool
from zerohop.client.replica import Replica
from zerohop.client.surfaces import Surface, UpstreamFailed, sse_events, surface_for

log = logging.getLogger(__name__)

GAVE_UP = "every replica failed while streaming this answer"
OVERLOADED = {429, 503, 529}  # the replica works but is full: not a breaker failure
# Hop-by-hop, or recomputed for the body actually sent.
_REQUEST_HEADERS_DROPPED = {b"host", b"content-length", b"transfer-encoding", b"connection"}
_STREAM_HEADERS_DROPPED = {"content-length", "transfer-encoding", "connection"}


@dataclass(slots=True, frozen=True)
class FailoverPolicy:
    max_attempts: int = 4  # replicas tried for one request, mid-stream continuations included
    deadline: float = 30.0  # seconds to find a replica that answers, each time one is needed


def retryable(response: httpx2.Response) -> bool:
    status = response.status_code
    if status == 429:
        headers = response.headers
        return "retry-after" in headers or "retry-after-ms" in headers
    return status >= 500


class Failover:
    """Runs requests over a pool with one async transport (one event loop's connections)."""

    def __init__(
        self,
        pool: ReplicaPool,
        policy: FailoverPolicy,
        http: httpx2.AsyncBaseTransport,
        grpc: AsyncUpstream | None = None,
    ) -> None:
        self.pool, self.policy, self.http = pool, policy, http
        self.grpc = grpc

    async def send(self, request: httpx2.Request) -> httpx2.Response:
        await self.pool.astart()  # at once but the first time (see ReplicaPool.start)
        body = await request.aread()
        surface = surface_for(request.method, request.url.path, body)
        return await _Call(self, request, surface).start(body)

    async def upstream(
        self, replica: Replica, request: httpx2.Request, body: bytes
    ) -> httpx2.Response:
        if replica.url.startswith("grpc"):
            if self.grpc is None:
                raise httpx2.ConnectError(f"{replica.url}: gRPC replicas need the gRPC bridge")
            return await self.grpc.open(replica, request, body)
        headers = [
            (k, v) for k, v in request.headers.raw if k.lower() not in _REQUEST_HEADERS_DROPPED
        ]
        url = httpx2.URL(replica.url + request.url.raw_path.decode("ascii"))
        forwarded = httpx2.Request(
            request.method, url, headers=headers, content=body, extensions=request.extensions
        )
        return await self.http.handle_async_request(forwarded)

    async def aclose(self) -> None:
        await self.http.aclose()
        if self.grpc is not None:
            await self.grpc.aclose()


class AsyncUpstream:
    """Another way to reach a replica (the gRPC bridge): an httpx-shaped answer."""

    async def open(self, replica: Replica, request: httpx2.Request, body: bytes) -> httpx2.Response:
        raise NotImplementedError

    async def aclose(self) -> None:
        return None


class _Call:
    """One caller's request, across however many replicas it takes."""

    def __init__(self, failover: Failover, request: httpx2.Request, surface: Surface | None):
        self.failover, self.request, self.surface = failover, request, surface
        self.pool = failover.pool
        self.prompt = surface.affinity_text() if surface is not None else str(request.url.path)
        self.pinned = pinning.named_id(request.method, request.url.path, surface)
        self.learns = pinning.learns(surface)
        self.attempts = 0

    async def start(self, body: bytes) -> httpx2.Response:
        surface = self.surface
        streaming = surface is not None and surface.streaming
        if surface is not None:
            body = orjson.dumps(surface.first_body())
        replica, response = await self.open(body, set(), buffered=not streaming)
        if replica is None or not streaming or response.status_code != 200:
            if replica is not None and response.status_code == 200:
                self._learn_whole(replica, response)  # a whole answer
            return response
        headers = [
            (k, v)
            for k, v in response.headers.multi_items()
            if k.lower() not in _STREAM_HEADERS_DROPPED
        ]
        stream = _ResumingStream(self, replica, response)
        return httpx2.Response(response.status_code, headers=headers, stream=stream)

    def _learn_whole(self, replica: Replica, response: httpx2.Response) -> None:
        if self.learns and isinstance(response.stream, RawBytes):  # `_buffered`'s bytes
            encoding = response.headers.get("content-encoding", "")
            self.pool.pins.learn(pinning.id_in_body(response.stream.raw, encoding), replica.url)

    async def open(
        self, body: bytes, exclude: set[str], buffered: bool
    ) -> tuple[Replica | None, httpx2.Response]:
        """The first good answer; (None, last answer) when every try failed with one."""
        deadline = time.monotonic() + self.failover.policy.deadline
        last: httpx2.Response | None = None
        error: Exception | None = None
        while self.attempts < self.failover.policy.max_attempts and time.monotonic() < deadline:
            try:
                replica, _ = self.pool.choose(self.prompt, exclude, self.pinned)
            except LookupError as exc:
                error = error or exc
                break
            self.attempts += 1
            try:
                response = await self.failover.upstream(replica, self.request, body)
                replica.observe(response.headers)
                if buffered or retryable(response):
                    response = await _buffered(response)
            except httpx2.TransportError as exc:
                log.info("replica %s failed: %r", replica.url, exc)
                error = exc
                self.pool.failed(replica, trip_breaker=True)
                exclude.add(replica.url)
                continue
            if retryable(response):
                last = response
                self.pool.failed(replica, trip_breaker=response.status_code not in OVERLOADED)
                exclude.add(replica.url)
                continue
            replica.breaker.succeeded()
            if buffered or response.status_code != 200:
                self.pool.release(replica)
            return replica, response
        if last is not None:
            return None, last
        if isinstance(error, httpx2.TransportError):
            raise error
        raise httpx2.ConnectError(f"no replica could take the request: {error}")


async def _buffered(response: httpx2.Response) -> httpx2.Response:
    """The response read whole, as raw bytes (the caller's client decodes them)."""
    try:
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    finally:
        await response.aclose()
    return httpx2.Response(
        response.status_code,
        headers=response.headers,
        stream=RawBytes(raw),
        extensions=response.extensions,
    )


class RawBytes(httpx2.AsyncByteStream):
    """A body already in memory, as raw bytes (not decoded: the caller's client does that;
    httpx2's own ByteStream would be read, and decoded, at once)."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.raw


class _ResumingStream(httpx2.AsyncByteStream):
    """The caller's stream: one replica's events, then another's if the first one breaks."""

    def __init__(self, call: _Call, replica: Replica, upstream: httpx2.Response) -> None:
        self.call, self.upstream = call, upstream
        self.replica: Replica | None = replica
        self.learning = call.learns  # until the answer's id has passed

    async def __aiter__(self) -> AsyncIterator[bytes]:
        surface = self.call.surface
        assert surface is not None
        while True:
            try:
                async for event in sse_events(self.upstream.aiter_raw()):
                    if self.learning:
                        self._learn(event)
                    if out := surface.feed(event):
                        yield out
                    if surface.done:
                        self._release()  # not in flight there any more, whenever it is closed
                        return
                raise UpstreamFailed("the stream ended before the answer did")
            except (httpx2.TransportError, UpstreamFailed) as exc:
                where = self.replica.url if self.replica is not None else "?"
                log.info("replica %s broke mid-stream: %r", where, exc)
                if not await self._move_on(isinstance(exc, httpx2.TransportError)):
                    yield surface.finish() if surface.done else surface.error_event(GAVE_UP)
                    return

    async def _move_on(self, trip_breaker: bool) -> bool:
        """Continue on another replica; False when there is nothing to continue on."""
        surface, failed = self.call.surface, self.replica
        assert surface is not None and failed is not None  # a stream, on a replica
        self.replica = None
        await self.upstream.aclose()
        self.call.pool.failed(failed, trip_breaker, resumed=surface.resumable)
        if not surface.resumable:
            return False
        body = surface.continuation()
        if body is None:
            surface.done = True
            return False
        try:
            replica, response = await self.call.open(orjson.dumps(body), {failed.url}, False)
        except httpx2.TransportError:
            return False
        if replica is None or response.status_code != 200:
            if replica is not None:
                self.call.pool.release(replica)
            return False
        self.replica, self.upstream = replica, response
        # The id the caller holds is kept there now (a continued response's, which the
        # continuation carries; a thread turn's, started over there): learned from its events.
        self.learning = self.call.learns
        return True

    def _learn(self, event: bytes) -> None:
        answer_id = pinning.id_in_event(event)
        if answer_id is not None and self.replica is not None:
            self.call.pool.pins.learn(answer_id, self.replica.url)
            self.learning = False

    def _release(self) -> None:
        if self.replica is not None:
            self.call.pool.release(self.replica)
            self.replica = None

    async def aclose(self) -> None:
        await self.upstream.aclose()
        self._release()
