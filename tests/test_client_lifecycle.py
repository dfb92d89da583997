"""zerohop.client's manners, as httpx's: making a pool, a client or a transport starts no
thread and does no I/O; the first request starts the pool (waiting, bounded, for the first
discovery round); `with` / `async with` / `close()` stop what was started, and only that;
streams are their own objects, which close their response when left."""

from __future__ import annotations

import asyncio
import gc
import socket
import ssl
import threading

import pytest

from tests.live_server import MODEL_NAME, free_port
from zerohop.client import (
    AsyncClient,
    Client,
    ReplicaPool,
    async_http_client,
    http_client,
)
from zerohop.client.api import AsyncStream, Stream

QUESTION = [{"role": "user", "content": "What is the sea?"}]


def pool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "zerohop-client"]


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


class SlowSource:
    """Discovery that takes a while to answer; `answered` is set once it has."""

    def __init__(self, urls: list[str], delay: float) -> None:
        self._urls, self.delay = urls, delay
        self.answered = threading.Event()

    async def urls(self) -> list[str]:
        await asyncio.sleep(self.delay)
        self.answered.set()
        return list(self._urls)


def test_making_and_dropping_starts_no_thread_and_does_no_io(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = dead_url()
    io: list[str] = []
    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", lambda *a, **k: io.append("CA"))
    monkeypatch.setattr(socket, "socket", lambda *a, **k: io.append("socket"))
    before = set(threading.enumerate())  # others' threads may end meanwhile, none may start
    made = [
        ReplicaPool([url, "grpc://127.0.0.1:1"]),
        Client([url]),
        AsyncClient([url]),
        http_client([url]),
        async_http_client([url]),
    ]
    assert set(threading.enumerate()) <= before and not pool_threads()
    assert not any(m.running for m in made if isinstance(m, ReplicaPool))
    assert not io, "no CA bundle read, no socket made"
    del made
    gc.collect()
    assert set(threading.enumerate()) <= before and not pool_threads()


def test_with_starts_the_pool_and_closes_it() -> None:
    url = dead_url()
    with ReplicaPool([url]) as pool:
        assert pool.running and len(pool_threads()) == 1
        assert set(pool.replicas) == {url}, "entering waits for the first discovery round"
    assert not pool.running and not pool_threads()
    pool.close()  # twice is fine
    with pytest.raises(RuntimeError):
        pool.choose("x", set())


def test_async_with_starts_the_pool_and_closes_it() -> None:
    url = dead_url()

    async def run() -> None:
        async with ReplicaPool([url]) as pool:
            assert pool.running and len(pool_threads()) == 1
            assert set(pool.replicas) == {url}
        assert not pool.running and not pool_threads()

    asyncio.run(run())


def test_the_first_choice_waits_for_the_first_discovery_round() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # health checks get no answer
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        source = SlowSource([url], delay=0.3)
        pool = ReplicaPool(source)
        try:
            replica, _ = pool.choose("x", set())
            # It returned after the first round answered: the one way to know this replica.
            assert replica.url == url and source.answered.is_set()
        finally:
            pool.close()
    assert not pool_threads()


def test_the_first_wait_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("zerohop.client.pool.FIRST_ROUND_WAIT", 0.2)
    source = SlowSource([dead_url()], delay=30)
    pool = ReplicaPool(source)
    try:
        pool.start()
        with pytest.raises(LookupError):
            pool.choose("x", set())  # no replica known yet
        assert not source.answered.is_set()  # it gave up waiting before the round ended
    finally:
        pool.close()
    assert not pool_threads()


def test_clients_close_the_pool_they_made_and_only_that() -> None:
    with Client([dead_url()]) as client:
        client.pool.start()
        assert client.pool.running
    assert not client.pool.running and not pool_threads()

    with ReplicaPool([dead_url()]) as shared:
        with Client(pool=shared):
            pass
        with http_client(pool=shared):
            pass
        assert shared.running, "a pool the caller passed stays open"

        async def run() -> None:
            async with AsyncClient(pool=shared):
                pass
            async with async_http_client(pool=shared):
                pass

        asyncio.run(run())
        assert shared.running
    assert not pool_threads()

    async def owned() -> None:
        async with AsyncClient([dead_url()]) as client:
            await client.pool.astart()
        assert not client.pool.running
        async with async_http_client([dead_url()]) as http:
            with pytest.raises(Exception):  # noqa: B017 (nothing listens: any transport error)
                await http.get("http://zerohop/ready")
        assert not pool_threads()

    asyncio.run(owned())


def test_http_client_starts_its_pool_on_the_first_request_and_closes_it() -> None:
    with http_client([dead_url()]) as http:
        assert not pool_threads()
        with pytest.raises(Exception):  # noqa: B017 (nothing listens: any transport error)
            http.get("http://zerohop/ready")
        assert len(pool_threads()) == 1
    assert not pool_threads()


def test_whole_answers_and_streams_have_their_own_methods() -> None:
    with Client([dead_url()]) as client:
        with pytest.raises(TypeError, match="stream_messages"):
            client.messages(model=MODEL_NAME, max_tokens=1, messages=QUESTION, stream=True)
        stream = client.stream_chat(model=MODEL_NAME, messages=QUESTION)
        assert isinstance(stream, Stream)
        stream.close()  # never read: nothing was sent
        assert isinstance(client.generate(model=MODEL_NAME, prompt="x"), Stream)
    assert isinstance(AsyncClient([dead_url()]).stream_completions(prompt="x"), AsyncStream)


def test_a_stream_left_early_closes_its_response(live_server) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 12, "temperature": 0, "messages": QUESTION}
    with Client([live_server.url]) as client:
        whole = client.messages(**body)
        with client.stream_messages(**body) as stream:
            first = next(stream)
        assert first["type"] == "message_start"
        assert client.pool.replicas[live_server.url].in_flight == 0
        with client.stream_messages(**body) as stream:
            events = list(stream)
        text = "".join(e["delta"].get("text", "") for e in events if e["type"].endswith("delta"))
        assert text == whole["content"][0]["text"]
        assert events[-1]["type"] == "message_stop"

    async def run() -> None:
        async with AsyncClient([live_server.url]) as client:
            async with client.stream_messages(**body) as stream:
                first = await anext(stream)
            assert first["type"] == "message_start"
            assert client.pool.replicas[live_server.url].in_flight == 0
            async with client.stream_messages(**body) as stream:
                events = [event async for event in stream]
            assert events[-1]["type"] == "message_stop"

    asyncio.run(run())
    assert not pool_threads()
