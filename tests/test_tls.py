"""TLS on the main port: ALPN picks h2 or http/1.1; the APIs work over both."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.live_server import MODEL_NAME, LiveServer


@pytest.fixture(scope="module")
def tls_server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    args = ["--tls-cert", str(cert), "--tls-key", str(key), "--grpc-port", "0"]
    server = LiveServer(llama_dir, args).start(folder / "server.log")
    yield server, cert
    server.stop()


@pytest.mark.parametrize(("http2", "version"), [(True, "HTTP/2"), (False, "HTTP/1.1")])
def test_alpn_negotiates_and_messages_work(tls_server, http2: bool, version: str) -> None:
    server, cert = tls_server
    assert server.url.startswith("https://")
    body = {"model": MODEL_NAME, "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}
    trust = ssl.create_default_context(cafile=str(cert))
    with httpx.Client(verify=trust, http2=http2, timeout=30) as client:
        response = client.post(server.url + "/v1/messages", json=body)
    assert response.http_version == version
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["output_tokens"] >= 1
    assert response.headers["request-id"].startswith("req_")
