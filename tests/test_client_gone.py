"""A client that hangs up is a 499 on every surface: Messages, Chat, Completions and Responses,
whole or streamed, and a cancelled gRPC call. The audit record, the `zerohop_requests` metric
and the engine (its request aborted, its KV blocks freed) all say so; none of them counts it as
an overload (529/503) or as a success (200).

One slow server (`--debug-step-delay`: 200 tokens take 10 s, far past each hang-up) with a key
store, an audit folder and /metrics; each case has a key and tenant of its own, so it reads its
own audit record and counter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from tests.test_gateway_limits import create_keys, records_of, requests_counted, wait_until
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

STEP_DELAY = 0.05
LONG = 200  # output tokens: 10 s on the slow server
HANG_UP_AFTER = 0.6  # seconds a whole-answer client waits before it goes
CHAT = [{"role": "user", "content": "Tell me about the quick brown fox."}]
# Messages and Responses have no ignore_eos: greedy decoding makes their answers the same
# every run, and test_the_answers_are_long_enough checks that they outlast each hang-up.

# case: (path, body, metric surface)
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "messages": (
        "/v1/messages",
        {"max_tokens": LONG, "messages": CHAT, "temperature": 0},
        "anthropic",
    ),
    "chat": (
        "/v1/chat/completions",
        {"max_tokens": LONG, "messages": CHAT, "ignore_eos": True},
        "openai",
    ),
    "completions": (
        "/v1/completions",
        {"max_tokens": LONG, "prompt": "The quick brown fox", "ignore_eos": True},
        "openai",
    ),
    "responses": (
        "/v1/responses",
        {"max_output_tokens": LONG, "input": CHAT, "temperature": 0},
        "openai",
    ),
}
KEYS = {f"{case}-{way}": (f"{case}-{way}", []) for case in CASES for way in ("whole", "stream")}
KEYS |= {"grpc": ("grpc", []), "long": ("long", [])}


class Gone:
    """The slow server, its audit folder and the keys made for it."""

    def __init__(self, server: LiveServer, audit_dir: Path, keys: dict[str, dict]) -> None:
        self.server, self.audit_dir, self.keys = server, audit_dir, keys

    def headers(self, name: str) -> dict[str, str]:
        return {
            "x-api-key": self.keys[name]["key"],
            "authorization": f"Bearer {self.keys[name]['key']}",
        }

    def record(self, name: str) -> dict[str, Any]:
        records = records_of(self.audit_dir, self.keys[name], 1, timeout=15)
        assert len(records) == 1, records
        return records[0]

    def requests_counted(self, name: str) -> dict[str, float]:
        """zerohop_requests_total for the key's tenant, by surface and status, once counted
        (/metrics renders these counters at most once a second)."""
        tenant = self.keys[name]["tenant"]
        return wait_until(lambda: requests_counted(self.server, tenant), timeout=5)

    def engine_idle(self) -> dict[str, Any]:
        def idle() -> dict[str, Any] | None:
            stats = httpx.get(self.server.url + "/engine/stats", timeout=5).json()
            free = stats["num_running"] == 0 and stats["blocks_in_use"] == 0
            return stats if free else None

        return wait_until(idle, timeout=15) or {}


@pytest.fixture(scope="module")
def gone(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gone]:
    root = tmp_path_factory.mktemp("client_gone")
    db, audit = root / "keys.db", root / "audit"
    keys = create_keys(db, KEYS)
    args = ["--keys-db", str(db), "--audit-dir", str(audit), "--debug-step-delay", str(STEP_DELAY)]
    server = LiveServer(llama_dir, args).start(root / "server.log")
    yield Gone(server, audit, keys)
    server.stop()


def hang_up_on_the_whole_answer(gone: Gone, name: str, path: str, body: dict) -> None:
    with pytest.raises(httpx.ReadTimeout):
        answered = httpx.post(
            gone.server.url + path,
            json={"model": MODEL_NAME, **body},
            headers=gone.headers(name),
            timeout=httpx.Timeout(60, read=HANG_UP_AFTER),
        )
        pytest.fail(f"answered before the hang-up: {answered.status_code} {answered.text[:300]}")


def hang_up_on_the_stream(gone: Gone, name: str, path: str, body: dict) -> None:
    request = {"model": MODEL_NAME, **body, "stream": True}
    with httpx.stream(
        "POST", gone.server.url + path, json=request, headers=gone.headers(name), timeout=60
    ) as response:
        assert response.status_code == 200
        read = 0
        for chunk in response.iter_bytes():
            read += len(chunk)
            if read > 2000:  # some tokens have come: leave mid-answer
                break


HANG_UPS: dict[str, Callable[[Gone, str, str, dict], None]] = {
    "whole": hang_up_on_the_whole_answer,
    "stream": hang_up_on_the_stream,
}


@pytest.mark.parametrize("way", HANG_UPS)
@pytest.mark.parametrize("case", CASES)
def test_a_client_that_hangs_up_is_a_499(gone: Gone, case: str, way: str) -> None:
    path, body, surface = CASES[case]
    name = f"{case}-{way}"
    HANG_UPS[way](gone, name, path, body)
    record = gone.record(name)
    assert (record["status"], record["error_type"]) == (499, "client_disconnected"), record
    assert record["output_tokens"] < LONG  # cut short: the engine stopped generating it
    assert gone.requests_counted(name) == {f"{surface}:499": 1.0}
    assert gone.engine_idle(), "the request still runs in the engine"


def test_a_cancelled_grpc_call_is_a_499(gone: Gone) -> None:
    assert gone.server.grpc_port is not None
    request = pb.GenerateRequest(
        model=MODEL_NAME, prompt="cancel me", max_tokens=LONG, ignore_eos=True
    )
    with grpc.insecure_channel(f"127.0.0.1:{gone.server.grpc_port}") as channel:
        metadata = (("x-api-key", gone.keys["grpc"]["key"]),)
        call = pb_grpc.ZerohopStub(channel).Generate(request, metadata=metadata)
        assert next(call).token_ids
        call.cancel()
    record = gone.record("grpc")
    assert (record["status"], record["error_type"]) == (499, "client_disconnected"), record
    assert gone.requests_counted("grpc") == {"grpc:499": 1.0}
    assert gone.engine_idle(), "the request still runs in the engine"


@pytest.mark.parametrize("case", ["messages", "responses"])
def test_the_answers_are_long_enough(gone: Gone, case: str) -> None:
    """Left alone, the greedy answers the hang-ups cut run to LONG tokens (no early end)."""
    path, body, _ = CASES[case]
    response = httpx.post(
        gone.server.url + path,
        json={
            "model": MODEL_NAME,
            **body,
            "max_tokens" if case == "messages" else "max_output_tokens": 40,
        },
        headers=gone.headers("long"),
        timeout=60,
    )
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["output_tokens"] == 40, usage
