"""Connection protection on real sockets: the connection caps, the request-head deadline,
the keep-alive close of silent connections, and what every response says about the server."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import h2.config
import h2.connection
import httpx
import pytest

from tests.live_server import MODEL_NAME, LiveServer, started_together

HEADER_TIMEOUT = 1.5
KEEP_ALIVE = 3.0
PER_ADDRESS = 8
GLOBAL_CAP = 4
# A safety net only, never what a test checks: how long a read waits for a close that is due.
# What closed a connection is read from the server's own counters (GET /metrics).
SAFETY = 30.0
TIMED_OUT = "zerohop_connections_timed_out_total"  # connections closed by the head deadline
REFUSED = tuple(
    f'zerohop_connections_refused_total{{reason="{reason}"}}'
    for reason in ("max_connections", "max_connections_per_address")
)

HALF_HEAD = b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n"
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
MESSAGE = json.dumps(
    {"model": MODEL_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
).encode()


@pytest.fixture(scope="module")
def servers(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The guarded server of most tests, and one with a global cap of 4, started together."""
    specs = {
        "main": [
            "--header-timeout", str(HEADER_TIMEOUT), "--keep-alive-timeout", str(KEEP_ALIVE),
            "--max-connections-per-address", str(PER_ADDRESS), "--max-connections", "64",
        ],
        "capped": [
            "--max-connections", str(GLOBAL_CAP), "--max-connections-per-address", "100",
            "--header-timeout", "30", "--keep-alive-timeout", "30",
        ],
    }  # fmt: skip
    specs = {name: ["--grpc-port", "0", *args] for name, args in specs.items()}
    with started_together(llama_dir, specs, tmp_path_factory) as started:
        yield started


@pytest.fixture(scope="module")
def server(servers) -> LiveServer:
    return servers["main"]


@pytest.fixture(scope="module")
def capped(servers) -> LiveServer:
    return servers["capped"]


# Raw sockets ------------------------------------------------------------------------------


def connect(server: LiveServer, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(
        ("127.0.0.1", server.port), timeout=10, source_address=(source, 0)
    )


def read_to_close(sock: socket.socket, timeout: float) -> tuple[bytes, str]:
    """Everything the server sends until it closes, or `timeout` seconds pass:
    (bytes, 'eof'|'reset'|'open')."""
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return data, "open"
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return data, "open"
        except ConnectionResetError:
            return data, "reset"
        if not chunk:
            return data, "eof"
        data += chunk


def still_open(sock: socket.socket) -> bool:
    """True when the server has neither sent anything nor closed `sock` (checked at once)."""
    sock.setblocking(False)
    try:
        return not sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)


def metric(server: LiveServer, sample: str) -> float:
    """One sample of the server's GET /metrics, by its name with labels."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == sample:
            return float(value)
    raise AssertionError(f"{sample} not in /metrics:\n{text}")


def read_response(sock: socket.socket, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a content-length: (status, headers, body)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, headers = parse_head(head)
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-body: {body!r}"
        body += chunk
    return status, headers, body


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers


def check_408(data: bytes) -> None:
    head, _, body = data.partition(b"\r\n\r\n")
    status, headers = parse_head(head)
    assert status == 408, data
    assert headers["connection"] == "close"
    assert headers["server"] == "zerohop"
    assert json.loads(body)["error"]


def refused(server: LiveServer, source: str = "127.0.0.1") -> bool:
    """True when a new connection is dropped at once, before any response to a request."""
    try:
        sock = connect(server, source)
    except OSError:
        return True
    with sock:
        try:
            sock.sendall(HEALTH)
        except OSError:
            return True
        data, how = read_to_close(sock, SAFETY)  # served: a response, then the keep-alive close
    return how != "open" and not data


class Holder:
    """A connection kept open by the server: a request whose body is withheld."""

    def __init__(self, server: LiveServer, source: str = "127.0.0.1") -> None:
        self.sock = connect(server, source)
        head = (
            "POST /v1/messages HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(MESSAGE)}\r\nexpect: 100-continue\r\n\r\n"
        )
        self.sock.sendall(head.encode())
        self.sock.settimeout(10)
        try:
            interim = self.sock.recv(4096)  # the app reads the body: the server holds us
        except ConnectionResetError:
            interim = b""
        self.admitted = interim.startswith(b"HTTP/1.1 100")

    def finish(self) -> int:
        self.sock.sendall(MESSAGE)
        status, _, body = read_response(self.sock, timeout=30)
        assert status == 200, body
        return status

    def close(self) -> None:
        self.sock.close()


def hold(server: LiveServer, count: int, source: str = "127.0.0.1") -> list[Holder]:
    """`count` admitted holders; retries while the server still counts a closed connection."""
    holders: list[Holder] = []
    deadline = time.monotonic() + 10
    while len(holders) < count:
        holder = Holder(server, source)
        if holder.admitted:
            holders.append(holder)
            continue
        holder.close()
        assert time.monotonic() < deadline, f"only {len(holders)} of {count} admitted"
        time.sleep(0.2)
    return holders


def served(server: LiveServer, source: str = "127.0.0.1", within: float = SAFETY) -> bool:
    """True once a fresh connection from `source` is answered 200 on /health."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        transport = httpx.HTTPTransport(local_address=source)
        try:
            with httpx.Client(transport=transport, timeout=5) as client:
                if client.get(server.url + "/health").status_code == 200:
                    return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


# The request-head deadline ----------------------------------------------------------------


def test_half_head_gets_408_and_close(server: LiveServer) -> None:
    before = metric(server, TIMED_OUT)
    with connect(server) as sock:
        sock.sendall(HALF_HEAD)
        data, how = read_to_close(sock, SAFETY)
    assert how in ("eof", "reset"), (how, data)
    check_408(data)
    assert metric(server, TIMED_OUT) == before + 1, "not closed by the head deadline"


def test_second_head_on_kept_alive_connection_has_the_deadline_too(server: LiveServer) -> None:
    before = metric(server, TIMED_OUT)
    with connect(server) as sock:
        sock.sendall(HEALTH)
        status, headers, _ = read_response(sock)
        assert status == 200 and headers["server"] == "zerohop"
        sock.sendall(HALF_HEAD)  # uvicorn's keep-alive timer stops with these bytes
        data, how = read_to_close(sock, SAFETY)
    assert how in ("eof", "reset"), (how, data)
    check_408(data)
    assert metric(server, TIMED_OUT) == before + 1, "not closed by the head deadline"


def test_head_dripped_byte_by_byte_is_still_cut(server: LiveServer) -> None:
    # Each byte arrives well within the deadline (one per 0.3 s), the head as a whole does
    # not: it is cut while bytes are still arriving, not once the last one is in.
    before = metric(server, TIMED_OUT)
    with connect(server) as sock:
        sock.settimeout(0.3)
        data, sent = b"", 0
        for byte in HALF_HEAD:
            try:
                sock.sendall(bytes([byte]))
                sent += 1
                data += sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
            if data:
                break
        rest, how = read_to_close(sock, SAFETY)
        data += rest
    assert how in ("eof", "reset"), how
    check_408(data)
    assert sent < len(HALF_HEAD), "cut only after the whole head: each byte reset the deadline"
    assert metric(server, TIMED_OUT) == before + 1, "not closed by the head deadline"


def test_stalled_body_is_not_cut_by_the_head_deadline(server: LiveServer) -> None:
    # The head is complete: the body's own deadline (--body-timeout, 30 s) applies, not the
    # head's. Only checks the connection outlives the head deadline; the body deadline is not
    # exercised here. A second connection, whose half head is sent once the server has read
    # this head (its 100 Continue says so), is cut by the head deadline: had this head's
    # deadline run on, it would have been cut before that one.
    before = metric(server, TIMED_OUT)
    with connect(server) as sock, connect(server) as control:
        head = (
            "POST /v1/messages HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(MESSAGE)}\r\nexpect: 100-continue\r\n\r\n"
        )
        sock.sendall(head.encode())
        sock.settimeout(SAFETY)
        interim = sock.recv(4096)
        assert interim.startswith(b"HTTP/1.1 100"), interim  # the app reads the body
        sock.sendall(MESSAGE[:10])
        control.sendall(HALF_HEAD)
        data, how = read_to_close(control, SAFETY)
        assert how in ("eof", "reset"), (how, data)
        check_408(data)
        assert still_open(sock), "a complete head was cut by the head deadline"
        assert metric(server, TIMED_OUT) == before + 1  # the control only
        sock.sendall(MESSAGE[10:])  # and the request still completes
        status, headers, _ = read_response(sock, timeout=30)
    assert status == 200 and headers["server"] == "zerohop"


# Silent connections and HTTP/2 ------------------------------------------------------------


def test_idle_and_undecided_connections_are_closed(server: LiveServer) -> None:
    # Three connections at once (their timers run together), each closed by a timer, the
    # keep-alive timeout or the head deadline:
    # - silent: never sends a byte;
    # - undecided: half the HTTP/2 preface, so neither HTTP/1.1 nor HTTP/2 is chosen yet;
    # - pipelined: a full request and half the next head in one write; the second head sits
    #   in the parser once the first response is sent (today the keep-alive timer closes it,
    #   without a 408: the head deadline is only armed by bytes that arrive while idle).
    refused_before = [metric(server, sample) for sample in REFUSED]
    silent, undecided, pipelined = connect(server), connect(server), connect(server)
    with silent, undecided, pipelined:
        undecided.sendall(b"PRI * HTTP/2.0\r\n")
        pipelined.sendall(HEALTH + HALF_HEAD)
        status, _, _ = read_response(pipelined)
        assert status == 200
        for name, sock in [("silent", silent), ("undecided", undecided)]:
            data, how = read_to_close(sock, SAFETY)
            assert how in ("eof", "reset") and data == b"", (name, how, data)
        data, how = read_to_close(pipelined, SAFETY)
        assert how in ("eof", "reset"), ("pipelined", how, data)
        assert data == b"" or data.startswith(b"HTTP/1.1 408"), data
    # Not refused at once by a cap (which also closes without a byte): closed by a timer.
    assert [metric(server, sample) for sample in REFUSED] == refused_before


def _h2_client() -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    return conn


def test_h2_preface_then_nothing_is_closed(server: LiveServer) -> None:
    before = metric(server, TIMED_OUT)
    conn = _h2_client()
    with connect(server) as sock:
        sock.sendall(conn.data_to_send())
        data, how = read_to_close(sock, SAFETY)
    assert how in ("eof", "reset"), how
    conn.receive_data(data)  # the server's SETTINGS: it did speak HTTP/2
    assert metric(server, TIMED_OUT) == before + 1, "not closed by the head deadline"


def test_h2_stalled_headers_frame_is_closed(server: LiveServer) -> None:
    conn = _h2_client()
    headers = [(":method", "GET"), (":path", "/health"), (":scheme", "http"), (":authority", "x")]
    conn.send_headers(1, headers, end_stream=True)
    wire = conn.data_to_send()
    before = metric(server, TIMED_OUT)
    with connect(server) as sock:
        sock.sendall(wire[:-4])  # the HEADERS frame never completes
        data, how = read_to_close(sock, SAFETY)
    assert how in ("eof", "reset"), how
    assert b"HTTP/1.1" not in data
    assert metric(server, TIMED_OUT) == before + 1, "not closed by the head deadline"


def test_h2_request_works(server: LiveServer) -> None:
    with httpx.Client(http1=False, http2=True, base_url=server.url, timeout=30) as client:
        health = client.get("/health")
        message = client.post("/v1/messages", content=MESSAGE)
    assert health.http_version == "HTTP/2" and health.status_code == 200
    assert message.status_code == 200, message.text
    assert message.headers["server"] == "zerohop"


# Connection caps ----------------------------------------------------------------------------


def test_per_address_cap(server: LiveServer) -> None:
    holders = hold(server, PER_ADDRESS)
    try:
        assert refused(server)  # the 9th from 127.0.0.1
        # Another client address is served meanwhile, generation included.
        transport = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(transport=transport, base_url=server.url, timeout=30) as other:
            assert other.get("/health").status_code == 200
            body = {**json.loads(MESSAGE), "max_tokens": 4}
            reply = other.post("/v1/messages", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["output_tokens"] >= 1
        # The held connections themselves are untouched by the refusal.
        holders.pop().finish()
    finally:
        for holder in holders:
            holder.close()
    assert served(server), "127.0.0.1 is not served again after its connections closed"


def test_global_cap(capped: LiveServer) -> None:
    holders = hold(capped, GLOBAL_CAP)
    try:
        assert refused(capped, "127.0.0.1")
        assert refused(capped, "127.0.0.2")
        holders.pop().finish()  # one completed request on a held connection ...
    finally:
        for holder in holders:
            holder.close()
    assert served(capped, "127.0.0.2")  # ... and the freed places serve again
    assert served(capped, "127.0.0.1")


# What responses say -------------------------------------------------------------------------


def _check_clean(response: httpx.Response) -> None:
    assert response.headers.get("server") == "zerohop", response.headers
    for name, value in response.headers.items():
        assert "uvicorn" not in f"{name}: {value}".lower()
    for leak in ("Traceback", "/work/", ".py", 'File "'):
        assert leak not in response.text, response.text


@pytest.mark.parametrize("http2", [False, True])
def test_server_header_and_clean_errors(server: LiveServer, http2: bool) -> None:
    with httpx.Client(http1=not http2, http2=http2, base_url=server.url, timeout=30) as client:
        json_type = {"content-type": "application/json"}
        bad_json = b'{"model": '
        cases = {
            "health": (client.get("/health"), 200),
            "unknown path": (client.get("/no/such/path"), 404),
            "bad json": (client.post("/v1/messages", content=bad_json, headers=json_type), 400),
            "wrong type": (
                client.post("/v1/messages", content=MESSAGE, headers={"content-type": "text/x"}),
                415,
            ),
            "not an object": (client.post("/v1/messages", content=b"[1]", headers=json_type), 400),
        }
    for case, (response, status) in cases.items():
        assert response.status_code == status, (case, response.text)
        _check_clean(response)


def test_server_header_on_protocol_level_errors(server: LiveServer) -> None:
    # An answer written below the app, by the HTTP/1.1 parser (the 408 is checked above).
    with connect(server) as sock:
        sock.sendall(b"GARBAGE\x00 / HTTP/1.1\r\nHost: x\r\n\r\n")
        data, _ = read_to_close(sock, SAFETY)
    head, _, body = data.partition(b"\r\n\r\n")
    status, headers = parse_head(head)
    assert status == 400, data
    assert b"uvicorn" not in data.lower()
    assert b"Traceback" not in body and b".py" not in body
    assert headers.get("server") == "zerohop", headers
