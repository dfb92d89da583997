"""The request-body deadline: a body that trickles in is cut with 408, a steady one is not."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest

from tests.live_server import MODEL_NAME, LiveServer

BODY = json.dumps(
    {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
).encode()


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("body-deadline") / "server.log"
    # 1 s plus 1 s per 64 bytes: the 110-byte body below may take about 2.7 s in all.
    args = ["--grpc-port", "0", "--body-timeout", "1", "--body-min-rate", "64"]
    live = LiveServer(llama_dir, args).start(log)
    yield live
    live.stop()


def _head(length: int) -> bytes:
    return (
        b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % length
    )


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_stalled_body_gets_408_and_the_connection_closes(server: LiveServer) -> None:
    # 30 s: a safety net for the read, not a figure checked; what is checked is the cause.
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(_head(len(BODY)) + BODY[:10])
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"connection: close" in reply.lower()
    assert b"too slowly" in reply and b'"type":"error"' in reply  # the Anthropic shape
    # The server's own account: cut by the body deadline with the 10 bytes sent, once its
    # 1 s (plus 10/64 s) had passed, not before.
    account = re.search(rb"\((\d+) bytes in (\d+) s\)", reply)
    assert account is not None, reply
    assert int(account[1]) == 10 and int(account[2]) >= 1, account[0]


def test_a_body_sent_steadily_within_the_rate_is_served(server: LiveServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(_head(len(BODY)))
        # 20 bytes every 0.3 s (~67 B/s > 64 B/s): 1.5 s in all, past the fixed 1 s part.
        for start in range(0, len(BODY), 20):
            sock.sendall(BODY[start : start + 20])
            time.sleep(0.3)
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
