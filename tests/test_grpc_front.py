"""The trusted front's end user on gRPC (issue 51): `x-claude-gateway-user-*` and
`x-litellm-end-user-id` metadata name the end user in the audit record, and its search, only
on a server whose --trusted-front holds the caller's address."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.live_server import MODEL_NAME, LiveServer, started_together
from tests.test_gateway_limits import audit_records, wait_until
from zerohop.api.grpc.front import peer_host
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

IDENTITY = (
    ("x-claude-gateway-user-id", "sub-7f3a"),
    ("x-claude-gateway-user-email", "ada%40example.com"),  # percent-encoded, as on HTTP
    ("x-litellm-end-user-id", "ada@example.com"),
)


@pytest.fixture(scope="module")
def servers(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("grpc_front")
    specs = {
        "trusted": ["--audit-dir", str(root / "a1"), "--trusted-front", "127.0.0.1"],
        "other": ["--audit-dir", str(root / "a2"), "--trusted-front", "10.9.9.9"],
    }
    with started_together(llama_dir, specs, tmp_path_factory) as started:
        yield {"root": root, **started}


def _generate(server: LiveServer, metadata: tuple[tuple[str, str], ...]) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = pb_grpc.ZerohopStub(channel)
        request = pb.GenerateRequest(model=MODEL_NAME, prompt="Hello", max_tokens=2)
        assert list(stub.Generate(request, metadata=metadata, timeout=60))


def _grpc_records(directory: Path, count: int) -> list[dict]:
    """The directory's gRPC records, once `count` are written (the writer flushes on a timer)."""

    def grpc_records() -> list[dict]:
        return [r for r in audit_records(directory) if r.get("surface") == "grpc"]

    found = wait_until(lambda: len(grpc_records()) >= count and grpc_records(), 10)
    assert found, audit_records(directory)
    return list(found)


def test_grpc_end_user_from_a_trusted_front_only(servers: dict) -> None:
    root = servers["root"]
    _generate(servers["trusted"], IDENTITY)
    _generate(servers["trusted"], (("x-litellm-end-user-id", "bob@example.com"),))
    _generate(servers["trusted"], ())
    _generate(servers["other"], IDENTITY)
    named = [(r.get("end_user"), r.get("end_user_email")) for r in _grpc_records(root / "a1", 3)]
    assert named == [
        ("sub-7f3a", "ada@example.com"),
        ("bob@example.com", None),
        (None, None),
    ]
    other = _grpc_records(root / "a2", 1)
    assert [(r.get("end_user"), r.get("end_user_email"), r["status"]) for r in other] == [
        (None, None, 200)
    ]


def test_peer_host_forms() -> None:
    assert peer_host("ipv4:127.0.0.1:5000") == "127.0.0.1"
    assert peer_host("ipv6:[::1]:5000") == "::1"
    assert peer_host("ipv6:[fe80::1%eth0]:5000") == "fe80::1"
    assert peer_host("unix:/tmp/socket") is None
    assert peer_host(None) is None
