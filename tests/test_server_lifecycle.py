"""Health never waits on the engine; SIGTERM drains in-flight streams and exits 0."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from zerohop import sse
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc


def _slow_server(llama_dir: Path, log: Path) -> LiveServer:
    return LiveServer(llama_dir, ["--grpc-port", "0", "--debug-step-delay", "0.05"]).start(log)


@pytest.fixture(scope="module")
def slow_server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    server = _slow_server(llama_dir, tmp_path_factory.mktemp("lifecycle") / "server.log")
    yield server
    server.stop()


@pytest.fixture
def draining_server(llama_dir: Path, tmp_path: Path):
    """A server of its own, for the test that ends it with SIGTERM."""
    server = _slow_server(llama_dir, tmp_path / "server.log")
    yield server
    server.stop()


def test_the_ports_bound_are_reported(slow_server: LiveServer) -> None:
    # --port 0 (LiveServer's): the port the server bound, in --port-file and on stdout;
    # --grpc-port 0: no gRPC server, and null for it.
    ports = json.loads(slow_server.port_file.read_text())
    assert ports == {"http": slow_server.port, "grpc": None}
    assert slow_server.port > 0
    announced = f"on http://127.0.0.1:{slow_server.port} (HTTP/1.1 and HTTP/2)\n"
    assert announced in slow_server.log(), slow_server.log()


def _engine_pid(server: LiveServer) -> int:
    pid = server.process.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def _stream_request(max_tokens: int) -> dict:
    return {
        "model": MODEL_NAME,
        "max_tokens": max_tokens,
        "stream": True,
        "messages": [{"role": "user", "content": "Tell me a story."}],
    }


def test_health_answers_while_the_engine_is_frozen(slow_server: LiveServer) -> None:
    engine_pid = _engine_pid(slow_server)
    # Freeze the engine process outright: only a probe that never touches it can answer.
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        with httpx.Client(base_url=slow_server.url, timeout=2.0) as client:
            for _ in range(20):
                assert client.get("/health").status_code == 200
                assert client.get("/ready").status_code == 200
    finally:
        os.kill(engine_pid, signal.SIGCONT)


def test_health_answers_while_the_engine_is_saturated(slow_server: LiveServer) -> None:
    url = slow_server.url + "/v1/messages"
    done: list[int] = []

    def one() -> None:
        body = _stream_request(40)
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            names = (e.name or b"" for e in sse.events(r.iter_bytes()))
            done.append(sum(1 for name in names if name.startswith(b"content")))

    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    with httpx.Client(base_url=slow_server.url, timeout=2.0) as client:
        for _ in range(20):
            assert client.get("/health").status_code == 200
            assert client.get("/ready").status_code == 200
        stats = client.get("/engine/stats").json()
    for t in threads:
        t.join()
    assert stats["num_running"] + stats["num_waiting"] > 0, "the engine was not busy"
    assert len(done) == 12


def test_sigterm_drains_streams_then_exits_zero(draining_server: LiveServer) -> None:
    url = draining_server.url + "/v1/messages"
    events: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", url, json=_stream_request(30), timeout=60) as r:
            for event in sse.events(r.iter_bytes()):
                if event.name is not None:
                    events.append(event.name.decode())
                    started.set()
                if event.data is not None and b'"message_delta"' in event.data:
                    events.append(json.loads(event.data)["delta"]["stop_reason"])

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(30)
    draining_server.process.send_signal(signal.SIGTERM)
    thread.join(60)
    assert draining_server.process.wait(60) == 0
    # Finished normally (sampling may reach end of turn before max_tokens), not cut off.
    assert events[-1] == "message_stop", events
    assert {"max_tokens", "end_turn"} & set(events), events
    with pytest.raises(httpx.ConnectError):
        httpx.get(draining_server.url + "/health", timeout=2.0)


# A gRPC stream of GRPC_TOKENS tokens at one token per engine step of at least GRPC_STEP_DELAY
# seconds: after AFTER_SIGTERM tokens it has run longer than the old 5 s cap on gRPC drain.
GRPC_STEP_DELAY, GRPC_TOKENS, AFTER_SIGTERM = 0.1, 80, 60


@pytest.fixture
def grpc_draining_server(llama_dir: Path, tmp_path: Path):
    args = ["--debug-step-delay", str(GRPC_STEP_DELAY), "--drain-seconds", "30"]
    server = LiveServer(llama_dir, args).start(tmp_path / "server.log")
    yield server
    server.stop()


def _grpc_stream(server: LiveServer, first: threading.Event, got: list) -> None:
    """Generate GRPC_TOKENS tokens; `got` gets each message's token count, then the end
    (a finish reason, or the status code that cut the stream)."""
    request = pb.GenerateRequest(
        model=MODEL_NAME, prompt="Tell me a story.", max_tokens=GRPC_TOKENS, ignore_eos=True
    )
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        try:
            for message in pb_grpc.ZerohopStub(channel).Generate(request, timeout=120):
                got.append(len(message.token_ids))
                first.set()
                if message.finish_reason:
                    got.append(pb.FinishReason.Name(message.finish_reason))
        except grpc.RpcError as exc:
            got.append(exc.code())
        finally:
            first.set()


def test_sigterm_drains_grpc_streams_for_drain_seconds(grpc_draining_server) -> None:
    first, got = threading.Event(), []
    thread = threading.Thread(target=_grpc_stream, args=(grpc_draining_server, first, got))
    thread.start()
    assert first.wait(60) and got and isinstance(got[0], int), got
    tokens_before = sum(n for n in list(got) if isinstance(n, int))
    grpc_draining_server.process.send_signal(signal.SIGTERM)
    thread.join(120)  # a safety net: the stream ends by itself
    assert grpc_draining_server.process.wait(60) == 0
    assert got[-1] == "FINISH_REASON_LENGTH", got[-5:]
    assert sum(got[:-1]) == GRPC_TOKENS
    # Most of the stream was generated after SIGTERM, so it ran past 5 s of drain.
    assert GRPC_TOKENS - tokens_before >= AFTER_SIGTERM


def _wait_closed(server: LiveServer) -> None:
    """Until the HTTP port is closed (the first thing a drain does)."""
    for _ in range(600):  # a safety net
        try:
            httpx.get(server.url + "/health", timeout=2.0)
        except httpx.ConnectError:
            return
        except (httpx.ReadError, httpx.RemoteProtocolError):
            pass  # accepted as the port closed, then reset: closing, not closed yet
        time.sleep(0.05)
    raise AssertionError("the HTTP port stayed open after SIGTERM")


def test_a_second_sigterm_ends_grpc_streams_at_once(grpc_draining_server) -> None:
    first, got = threading.Event(), []
    thread = threading.Thread(target=_grpc_stream, args=(grpc_draining_server, first, got))
    thread.start()
    assert first.wait(60) and got and isinstance(got[0], int), got
    grpc_draining_server.process.send_signal(signal.SIGTERM)
    _wait_closed(grpc_draining_server)  # the first signal is handled: a second is not merged
    grpc_draining_server.process.send_signal(signal.SIGTERM)
    thread.join(120)  # a safety net
    assert grpc_draining_server.process.wait(60) == 0
    assert isinstance(got[-1], grpc.StatusCode), got[-5:]  # cut off, not finished
    assert sum(got[:-1]) < GRPC_TOKENS
