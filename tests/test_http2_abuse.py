"""HTTP/2 and gRPC abuse on real sockets: rapid reset, SETTINGS/PING floods, the per-connection
stream cap, oversized request heads (431), and the gRPC port's stream cap, message size
limit and ping strikes. The raw HTTP/2 client is the `h2` library; gRPC is grpcio."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import httpx
import pytest

from tests.live_server import MODEL_NAME, LiveServer, started_together
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

ENHANCE_YOUR_CALM, REFUSED_STREAM = 0xB, 0x7
MAX_RESETS, MAX_CONTROL_FRAMES = 200, 1000  # the server's defaults (guard.GuardLimits)
STREAM_CAP, GRPC_STREAMS, STEP_DELAY, MAX_BODY = 4, 2, 0.05, 65536

MESSAGES = "/v1/messages"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def _body(**fields: object) -> bytes:
    return json.dumps({"model": MODEL_NAME, "messages": USER, **fields}).encode()


@pytest.fixture(scope="module")
def servers(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server with the default HTTP/2 budgets (no gRPC), and a slow one with small stream
    caps on HTTP/2 and gRPC, started together."""
    specs = {
        "main": ["--grpc-port", "0"],
        "slow": [
            "--http2-max-streams", str(STREAM_CAP), "--debug-step-delay", str(STEP_DELAY),
            "--grpc-max-concurrent-streams", str(GRPC_STREAMS), "--max-body-bytes", str(MAX_BODY),
        ],
    }  # fmt: skip
    with started_together(llama_dir, specs, tmp_path_factory) as started:
        yield started


@pytest.fixture(scope="module")
def server(servers) -> LiveServer:
    return servers["main"]


@pytest.fixture(scope="module")
def slow(servers) -> LiveServer:
    return servers["slow"]


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    lines = (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")
    return {name: float(value) for name, value in lines}


def engine_stats(url: str) -> dict:
    return httpx.get(url + "/engine/stats", timeout=10).json()


def served_over_h2(url: str) -> None:
    with httpx.Client(http1=False, http2=True, base_url=url, timeout=30) as client:
        response = client.post(MESSAGES, content=_body(max_tokens=2))
    assert response.http_version == "HTTP/2"
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["output_tokens"] >= 1


class H2Client:
    """A raw HTTP/2 client on one socket, that does what it is told and no more."""

    def __init__(self, port: int) -> None:
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.events: list[h2.events.Event] = []
        self.closed: str | None = None  # "eof" or "reset" once the server closed
        self.send()

    def __enter__(self) -> H2Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self) -> bool:
        data = self.conn.data_to_send()
        try:
            self.sock.sendall(data)
        except OSError:  # the server closed already: what it sent is still to read
            return False
        return True

    def request(self, path: str, body: bytes | None = None, extra=(), end=True) -> int:
        stream_id = self.conn.get_next_available_stream_id()
        headers = [(":method", "POST" if body is not None else "GET"), (":path", path)]
        headers += [(":scheme", "http"), (":authority", "localhost"), *extra]
        if body is not None:
            headers.append(("content-type", "application/json"))
        self.conn.send_headers(stream_id, headers, end_stream=body is None and end)
        if body is not None:
            self.conn.send_data(stream_id, body, end_stream=end)
        return stream_id

    def pump(self, timeout: float) -> list[h2.events.Event]:
        """Read what arrives within `timeout` seconds (one read); [] on nothing."""
        if self.closed or not select.select([self.sock], [], [], timeout)[0]:
            return []
        try:
            data = self.sock.recv(1 << 20)
        except ConnectionResetError:
            data, self.closed = b"", "reset"
        if not data:
            self.closed = self.closed or "eof"
            return []
        events = self.conn.receive_data(data)
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.stream_id:
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        self.send()
        self.events += events
        return events

    def until(self, done, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not done() and not self.closed and time.monotonic() < deadline:
            self.pump(min(0.2, max(0.0, deadline - time.monotonic())))

    def goaway(self) -> h2.events.ConnectionTerminated | None:
        ends = [e for e in self.events if isinstance(e, h2.events.ConnectionTerminated)]
        return ends[0] if ends else None

    def of(self, stream_id: int) -> list[h2.events.Event]:
        return [e for e in self.events if getattr(e, "stream_id", None) == stream_id]

    def response(self, stream_id: int) -> tuple[int, dict[bytes, bytes], bytes]:
        events = self.of(stream_id)
        (head,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
        headers = dict(head.headers)
        body = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
        return int(headers[b":status"]), headers, body

    def ended(self, stream_id: int) -> bool:
        kinds = (h2.events.StreamEnded, h2.events.StreamReset)
        return any(isinstance(e, kinds) for e in self.of(stream_id))


# -- rapid reset (CVE-2023-44487) -------------------------------------------------------------


def test_rapid_reset_gets_goaway_and_frees_the_engine(server: LiveServer) -> None:
    before = metrics(server.url)
    with H2Client(server.port) as client:
        # A few streams the engine really admitted (their first tokens arrived), then reset.
        admitted = [client.request(CHAT, _body(max_tokens=1500, ignore_eos=True, stream=True))]
        admitted += [client.request(CHAT, _body(max_tokens=1500, ignore_eos=True, stream=True))]
        client.send()
        data = h2.events.DataReceived
        client.until(lambda: all(any(isinstance(e, data) for e in client.of(s)) for s in admitted))
        for _ in range(60):  # the engine's counters ride on its step frames
            if engine_stats(server.url)["num_running"] == len(admitted):
                break
            time.sleep(0.05)
        assert engine_stats(server.url)["num_running"] == len(admitted)
        for stream_id in admitted:
            client.conn.reset_stream(stream_id)
        # Then the loop: a streaming request, reset at once, as fast as the socket takes it.
        sent = len(admitted)
        while sent < 400 and client.goaway() is None and not client.closed:
            stream_id = client.request(MESSAGES, _body(max_tokens=50, stream=True))
            client.conn.reset_stream(stream_id)
            if not client.send():
                break
            sent += 1
            client.pump(0)
        client.until(lambda: client.goaway() is not None, timeout=10)
        goaway = client.goaway()
        assert goaway is not None, f"no GOAWAY after {sent} resets"
        assert goaway.error_code == ENHANCE_YOUR_CALM
        # The stream whose reset went over the budget is the last the server processed.
        resets = (goaway.last_stream_id + 1) // 2
        assert MAX_RESETS + 1 <= resets <= 260, goaway
        client.until(lambda: False, timeout=5)  # then the server closes the connection
        assert client.closed in ("eof", "reset")
    for _ in range(60):  # the engine aborts what it admitted at its next step
        stats = engine_stats(server.url)
        if stats["num_running"] == stats["num_waiting"] == stats["blocks_in_use"] == 0:
            break
        time.sleep(0.05)
    assert (stats["num_running"], stats["num_waiting"], stats["blocks_in_use"]) == (0, 0, 0)
    after = metrics(server.url)
    key = 'zerohop_http2_goaway_total{reason="resets"}'
    assert after[key] - before[key] == 1
    assert (
        after['zerohop_http2_goaway_total{reason="control_frames"}']
        == (before['zerohop_http2_goaway_total{reason="control_frames"}'])
    )
    served_over_h2(server.url)


def test_resets_within_the_budget_keep_the_connection(server: LiveServer) -> None:
    """A client that cancels many streams, but fewer than the budget, is served on."""
    before = metrics(server.url)
    with H2Client(server.port) as client:
        for _ in range(MAX_RESETS - 50):
            client.conn.reset_stream(client.request(MESSAGES, _body(max_tokens=50, stream=True)))
            client.send()
            client.pump(0)
        stream_id = client.request(MESSAGES, _body(max_tokens=2))
        client.send()
        client.until(lambda: client.ended(stream_id), timeout=30)
        assert client.goaway() is None and not client.closed
        status, _, body = client.response(stream_id)
        assert status == 200, body
    after = metrics(server.url)
    key = 'zerohop_http2_goaway_total{reason="resets"}'
    assert after[key] == before[key]


# -- SETTINGS / PING floods -------------------------------------------------------------------


@pytest.mark.parametrize("frame", ["ping", "settings"])
def test_control_frame_flood_gets_goaway(server: LiveServer, frame: str) -> None:
    before = metrics(server.url)
    acked = h2.events.PingAckReceived if frame == "ping" else h2.events.SettingsAcknowledged
    with H2Client(server.port) as client:
        sent = 0
        while sent < 1500 and client.goaway() is None and not client.closed:
            if frame == "ping":
                client.conn.ping(sent.to_bytes(8, "big"))
            else:
                window = h2.settings.SettingCodes.INITIAL_WINDOW_SIZE
                client.conn.update_settings({window: 65535 + sent})
            if not client.send():
                break
            sent += 1
            client.pump(0)
        client.until(lambda: False, timeout=10)  # read to the close
        goaway = client.goaway()
        assert goaway is not None and goaway.error_code == ENHANCE_YOUR_CALM, (sent, goaway)
        assert client.closed in ("eof", "reset")
        acks = sum(isinstance(e, acked) for e in client.events)
        # Everything within the budget was answered; nothing much past it.
        assert MAX_CONTROL_FRAMES - 10 <= acks <= MAX_CONTROL_FRAMES + 1, (sent, acks)
    after = metrics(server.url)
    key = 'zerohop_http2_goaway_total{reason="control_frames"}'
    assert after[key] - before[key] == 1
    served_over_h2(server.url)


# -- the per-connection stream cap ------------------------------------------------------------


def test_streams_over_the_cap_are_refused(slow: LiveServer) -> None:
    before = metrics(slow.url)
    body = _body(max_tokens=24, ignore_eos=True, stream=True)
    with H2Client(slow.port) as client:
        streams = [client.request(CHAT, body) for _ in range(STREAM_CAP + 2)]
        client.send()
        client.until(lambda: all(client.ended(s) for s in streams), timeout=30)
        for stream_id in streams[STREAM_CAP:]:
            (reset,) = [e for e in client.of(stream_id) if isinstance(e, h2.events.StreamReset)]
            assert reset.error_code == REFUSED_STREAM
            assert not [e for e in client.of(stream_id) if isinstance(e, h2.events.DataReceived)]
        for stream_id in streams[:STREAM_CAP]:
            assert not [e for e in client.of(stream_id) if isinstance(e, h2.events.StreamReset)]
            status, _, sse = client.response(stream_id)
            assert status == 200
            assert sse.rstrip().endswith(b"data: [DONE]")
            chunks = [json.loads(line[6:]) for line in sse.split(b"\n") if line[6:7] == b"{"]
            reasons = [choice["finish_reason"] for c in chunks for choice in c["choices"]]
            assert reasons[-1] == "length" and len(reasons) > 1
        # The cap is on streams at once: with the first ones done, the connection serves again.
        again = client.request("/v1/models")
        client.send()
        client.until(lambda: client.ended(again))
        assert client.response(again)[0] == 200
        assert client.goaway() is None
    after = metrics(slow.url)
    refused = after["zerohop_http2_streams_refused_total"]
    assert refused - before["zerohop_http2_streams_refused_total"] == 2


# -- oversized request heads ------------------------------------------------------------------


def test_http2_header_over_the_limit_is_431_in_each_api_shape(server: LiveServer) -> None:
    big = [("x-padding", "a" * 40 * 1024)]
    small = [("x-padding", "a" * 1024)]
    with H2Client(server.port) as client:
        chat = client.request(CHAT, _body(max_tokens=1), extra=big)
        messages = client.request(MESSAGES, _body(max_tokens=1), extra=big)
        fine = client.request(MESSAGES, _body(max_tokens=1), extra=small)
        client.send()
        client.until(lambda: all(client.ended(s) for s in (chat, messages, fine)))
        status, headers, body = client.response(chat)
        assert status == 431 and headers[b"content-type"] == b"application/json"
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and "32768" in error["message"]
        status, headers, body = client.response(messages)
        assert status == 431 and headers[b"content-type"] == b"application/json"
        answer = json.loads(body)
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
        assert answer["request_id"] == headers[b"request-id"].decode()
        status, _, body = client.response(fine)
        assert status == 200, body
        assert client.goaway() is None  # a 431 is the stream's answer, not the connection's


def test_http2_header_past_the_header_list_limit_closes_only_that_connection(
    server: LiveServer,
) -> None:
    # Past the 64 KiB the server advertises (SETTINGS_MAX_HEADER_LIST_SIZE), zttp refuses the
    # whole connection; nothing is served from it, and the server is unharmed.
    with H2Client(server.port) as client:
        stream_id = client.request(MESSAGES, _body(max_tokens=1), extra=[("x-big", "a" * 100_000)])
        client.send()
        client.until(lambda: False, timeout=10)
        assert client.closed in ("eof", "reset")
        statuses = [e for e in client.of(stream_id) if isinstance(e, h2.events.ResponseReceived)]
        assert all(dict(e.headers)[b":status"] != b"200" for e in statuses)
    served_over_h2(server.url)


def _http1(server: LiveServer, padding: int) -> tuple[bytes, str]:
    head = b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    body = _body(max_tokens=1)
    head += b"X-Padding: %s\r\nContent-Length: %d\r\n\r\n" % (b"a" * padding, len(body))
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        received, how = b"", "open"
        with contextlib.suppress(OSError):  # closed before it read it all: still to read
            sock.sendall(head + body)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                how = "reset"
                break
            except TimeoutError:
                break
            if not chunk:
                how = "eof"
                break
            received += chunk
            if padding < 4096 and b'"usage"' in received and received.rstrip().endswith(b"}"):
                break  # kept alive: the answer is complete, the connection stays open
    return received, how


def test_http1_header_over_the_limit_is_431_and_closes(server: LiveServer) -> None:
    answer, how = _http1(server, 40 * 1024)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]
    assert how in ("eof", "reset")
    answer, how = _http1(server, 1024)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert how == "open"


# -- gRPC ------------------------------------------------------------------------------------


# grpc-core queues calls over the server's MAX_CONCURRENT_STREAMS on the client, but a call
# sent as another one ends can still find the server counting the old one, and is refused
# (REFUSED_STREAM, UNAVAILABLE to the caller; ~20% of the calls over the cap). A client
# meant to go past the cap retries UNAVAILABLE, as this one does.
RETRY_UNAVAILABLE = {
    "methodConfig": [
        {
            "name": [{"service": "zerohop.v1.Zerohop"}],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.01s",
                "maxBackoff": "0.1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ]
}


@pytest.fixture(scope="module")
def grpc_channel(slow: LiveServer):
    options = [("grpc.service_config", json.dumps(RETRY_UNAVAILABLE))]
    with grpc.insecure_channel(f"127.0.0.1:{slow.grpc_port}", options=options) as channel:
        yield channel


def test_grpc_streams_over_the_cap_wait_their_turn(slow: LiveServer, grpc_channel) -> None:
    stub = pb_grpc.ZerohopStub(grpc_channel)
    request = pb.GenerateRequest(
        model=MODEL_NAME, prompt="hello", max_tokens=16, ignore_eos=True, temperature=0.0
    )
    list(stub.Generate(request, timeout=60))  # the connection is up before the clock starts
    start = time.monotonic()
    firsts: dict[int, float] = {}
    ends: dict[int, float] = {}
    tokens: dict[int, int] = {}
    errors: list[BaseException] = []

    def generate(i: int) -> None:
        try:
            count = 0
            for message in stub.Generate(request, timeout=60):
                firsts.setdefault(i, time.monotonic() - start)
                count += len(message.token_ids)
            tokens[i], ends[i] = count, time.monotonic() - start
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    running = []
    while any(thread.is_alive() for thread in threads):
        running.append(engine_stats(slow.url)["num_running"])
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert tokens == {i: 16 for i in range(4)}  # all four complete
    assert max(running) <= GRPC_STREAMS, running
    # Two start at once; the others start only once one of those has finished.
    starts, first_end = sorted(firsts.values()), min(ends.values())
    assert starts[1] < first_end, (firsts, ends)
    assert starts[2] >= first_end - 0.3, (firsts, ends)
    assert starts[2] >= starts[0] + 16 * STEP_DELAY * 0.9, (firsts, ends)


def test_grpc_message_over_max_body_is_resource_exhausted(grpc_channel) -> None:
    stub = pb_grpc.ZerohopStub(grpc_channel)
    big = pb.GenerateRequest(model=MODEL_NAME, prompt="a" * (MAX_BODY + 1000), max_tokens=1)
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Generate(big, timeout=30))
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    small = pb.GenerateRequest(model=MODEL_NAME, prompt="a" * 1000, max_tokens=1)
    assert list(stub.Generate(small, timeout=30))[-1].usage.completion_tokens == 1


def test_grpc_ping_flood_gets_too_many_pings(slow: LiveServer) -> None:
    # Keepalive enforcement: pings without data more often than every 300 s are strikes;
    # past 2, the server answers GOAWAY ENHANCE_YOUR_CALM "too_many_pings".
    with H2Client(slow.grpc_port) as client:
        for i in range(10):
            if client.goaway() is not None or client.closed:
                break
            client.conn.ping(i.to_bytes(8, "big"))
            if not client.send():
                break
            client.pump(0.05)
        client.until(lambda: client.goaway() is not None, timeout=10)
        goaway = client.goaway()
        assert goaway is not None and goaway.error_code == ENHANCE_YOUR_CALM
        assert goaway.additional_data == b"too_many_pings"
        assert sum(isinstance(e, h2.events.PingAckReceived) for e in client.events) <= 4
    with grpc.insecure_channel(f"127.0.0.1:{slow.grpc_port}") as channel:
        request = pb.GenerateRequest(model=MODEL_NAME, prompt="hi", max_tokens=1)
        assert list(pb_grpc.ZerohopStub(channel).Generate(request, timeout=30))
