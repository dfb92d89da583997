"""The two error kinds the engine's state decides, on every surface (Messages, Chat, Completions,
Responses, gRPC): a replica too full to queue another request refuses it as overloaded, and a
request in flight when the engine process dies ends as engine_dead. Each has the API's own
status (Anthropic 529, OpenAI 503, gRPC UNAVAILABLE), and the audit record and the
`zerohop_requests` metric say the same on every surface. (Invalid, rate-limited and
over-budget requests: tests/test_error_kinds.py; a client that hangs up: test_client_gone.py.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from tests.test_client_gone import CASES
from tests.test_engine_supervision import engine_pid
from tests.test_gateway_limits import create_keys, records_of, requests_counted, wait_until
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

SURFACES = [*CASES, "grpc"]
STATUS = {"messages": 529}  # the rest: 503 (gRPC: UNAVAILABLE)
LONG = 400  # output tokens: 20 s at the servers' step delay, far past each check
SAFETY_TIMEOUT = 120.0  # a safety net against a hang only; nothing asserts on time
KEYS = {name: (name, []) for name in [*SURFACES, "hold"]}


def serve(llama_dir: Path, root: Path, flags: list[str]) -> tuple[LiveServer, Path, dict]:
    db, audit = root / "keys.db", root / "audit"
    keys = create_keys(db, KEYS)
    args = ["--keys-db", str(db), "--audit-dir", str(audit), *flags]
    server = LiveServer(llama_dir, args).start(root / "server.log")
    return server, audit, keys


def ask(server: LiveServer, surface: str, key: str) -> int | grpc.StatusCode:
    """One long request (whole), answered by its status or gRPC code."""
    if surface == "grpc":
        request = pb.GenerateRequest(model=MODEL_NAME, prompt="The quick brown fox",
                                     max_tokens=LONG, ignore_eos=True)  # fmt: skip
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            call = pb_grpc.ZerohopStub(channel).Generate(request, metadata=(("x-api-key", key),))
            with contextlib.suppress(grpc.RpcError):  # its code tells
                list(call)
            return call.code()
    path, body, _ = CASES[surface]
    headers = {"x-api-key": key, "authorization": f"Bearer {key}"}
    request = {"model": MODEL_NAME, **body, "max_tokens": LONG} if "max_tokens" in body else {
        "model": MODEL_NAME, **body, "max_output_tokens": LONG}  # fmt: skip
    return httpx.post(server.url + path, json=request, headers=headers,
                      timeout=SAFETY_TIMEOUT).status_code  # fmt: skip


def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: outcome.update(result=target()), daemon=True)
    thread.start()
    return thread, outcome


def stats(server: LiveServer) -> dict[str, Any]:
    return httpx.get(server.url + "/engine/stats", timeout=10).json()


def wait_for(server: LiveServer, running: int, waiting: int = 0) -> None:
    deadline = time.monotonic() + SAFETY_TIMEOUT
    while True:
        now = stats(server)
        if now["num_running"] >= running and now["num_waiting"] >= waiting:
            return
        assert time.monotonic() < deadline, f"the requests never started: {now}"
        time.sleep(0.05)


def check_outcome(server: LiveServer, audit: Path, keys: dict, surface: str, kind: str) -> None:
    status = STATUS.get(surface, 503)
    (record,) = records_of(audit, keys[surface], 1, timeout=15)
    assert (record["status"], record["error_type"]) == (status, kind)
    label = {"messages": "anthropic", "grpc": "grpc"}.get(surface, "openai")
    tenant = keys[surface]["tenant"]
    assert wait_until(lambda: requests_counted(server, tenant) == {f"{label}:{status}": 1}, 5)


def expected_answer(surface: str) -> int | grpc.StatusCode:
    return grpc.StatusCode.UNAVAILABLE if surface == "grpc" else STATUS.get(surface, 503)


@pytest.fixture(scope="module")
def full(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A replica whose one running slot and one waiting place are taken by long requests."""
    flags = ["--max-num-seqs", "1", "--max-waiting", "1", "--debug-step-delay", "0.05",
             "--drain-seconds", "1"]  # fmt: skip
    server, audit, keys = serve(llama_dir, tmp_path_factory.mktemp("full"), flags)
    holders = []
    for waiting in (0, 1):  # one after the other: two at once could refuse the second
        holders.append(in_thread(lambda: ask(server, "chat", keys["hold"]["key"])))
        wait_for(server, running=1, waiting=waiting)
    yield server, audit, keys
    server.stop()
    for thread, _ in holders:
        thread.join(SAFETY_TIMEOUT)


@pytest.mark.parametrize("surface", SURFACES)
def test_a_full_replica_refuses_as_overloaded(full: Any, surface: str) -> None:
    server, audit, keys = full
    assert ask(server, surface, keys[surface]["key"]) == expected_answer(surface)
    check_outcome(server, audit, keys, surface, "overloaded")


def test_the_engine_dying_ends_each_surfaces_request_as_engine_dead(
    llama_dir: Path, tmp_path: Path
) -> None:
    server, audit, keys = serve(llama_dir, tmp_path, ["--debug-step-delay", "0.05"])
    try:
        runs = {s: in_thread(lambda s=s: ask(server, s, keys[s]["key"])) for s in SURFACES}
        wait_for(server, running=len(SURFACES))
        os.kill(engine_pid(server), signal.SIGKILL)
        for surface, (thread, outcome) in runs.items():
            thread.join(SAFETY_TIMEOUT)
            assert outcome.get("result") == expected_answer(surface), (surface, outcome)
            check_outcome(server, audit, keys, surface, "engine_dead")
    finally:
        server.stop()
