"""Message Batches end to end: the official `anthropic` SDK against a real `zerohop serve` on
the tiny model, with a real key store (two tenants) and a real batch store; a kill -9 in the
middle of a batch and a restart on the same files.

One server for the module (slowed to 20 ms a step so that lines are still running when a test
cancels or kills); the last test kills and restarts it."""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from tests.test_gateway_auth import cli_json

STEP_DELAY = "0.02"
SAFETY_TIMEOUT = 60.0  # seconds; a safety net, never a measurement


def params(max_tokens: int = 3, **extra) -> dict:
    messages = [{"role": "user", "content": "hi"}]
    return {"model": MODEL_NAME, "max_tokens": max_tokens, "messages": messages, **extra}


def wait_for(check: Callable[[], object], timeout: float = SAFETY_TIMEOUT) -> object:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


def tenant_keys(db: Path) -> dict:
    """A key store with a key of tenant acme and one of beta: {"db", "acme", "beta"}."""
    made = {
        tenant: cli_json("keys", "create", "--keys-db", db, "--tenant", tenant)["key"]
        for tenant in ("acme", "beta")
    }
    return {"db": db, **made}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return tenant_keys(tmp_path_factory.mktemp("batch_keys") / "keys.db")


@pytest.fixture(scope="module")
def server(llama_dir: Path, keys: dict, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("batch_server")
    args = ["--keys-db", str(keys["db"]), "--batches-db", str(folder / "batches.db")]
    srv = LiveServer(llama_dir, [*args, "--debug-step-delay", STEP_DELAY])
    srv.start(folder / "server.log")
    yield srv
    srv.stop()


def client(server: LiveServer, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def ended(sdk: anthropic.Anthropic, batch_id: str):
    def check():
        batch = sdk.messages.batches.retrieve(batch_id)
        return batch if batch.processing_status == "ended" else None

    return wait_for(check)


def results(sdk: anthropic.Anthropic, batch_id: str) -> dict:
    return {r.custom_id: r.result for r in sdk.messages.batches.results(batch_id)}


def test_create_retrieve_and_results(server, keys):
    sdk = client(server, keys["acme"])
    batch = sdk.messages.batches.create(
        requests=[
            {"custom_id": "ok-1", "params": params()},
            {"custom_id": "ok-2", "params": params(temperature=0)},
            {"custom_id": "no-max-tokens", "params": {"model": MODEL_NAME, "messages": []}},
            {"custom_id": "streams", "params": params(stream=True)},
            {"custom_id": "other-model", "params": {**params(), "model": "no-such-model"}},
        ]
    )
    assert batch.id.startswith("msgbatch_01") and batch.type == "message_batch"
    assert batch.processing_status == "in_progress" and batch.results_url is None
    assert batch.request_counts.processing == 5
    assert batch.expires_at.timestamp() - batch.created_at.timestamp() == pytest.approx(86400)
    done = ended(sdk, batch.id)
    assert done.ended_at is not None and done.results_url.endswith(f"/{batch.id}/results")
    counts = done.request_counts
    assert (counts.processing, counts.succeeded, counts.errored) == (0, 2, 3)
    answers = results(sdk, batch.id)
    assert sorted(answers) == ["no-max-tokens", "ok-1", "ok-2", "other-model", "streams"]
    for custom_id in ("ok-1", "ok-2"):
        message = answers[custom_id].message
        assert answers[custom_id].type == "succeeded" and message.model == MODEL_NAME
        assert 1 <= message.usage.output_tokens <= 3 and message.content[0].type == "text"
    kinds = {c: answers[c].error.error.type for c in ("no-max-tokens", "streams", "other-model")}
    assert kinds == {
        "no-max-tokens": "invalid_request_error",
        "streams": "invalid_request_error",
        "other-model": "not_found_error",
    }
    metrics = httpx.get(server.url + "/metrics").text
    assert 'zerohop_batch_lines{state="done",tenant="acme"}' in metrics


def test_whole_request_refusals_are_400s(server, keys):
    sdk = client(server, keys["acme"])
    bad = [
        [],
        [{"custom_id": "same", "params": params()}, {"custom_id": "same", "params": params()}],
        [{"custom_id": "has space", "params": params()}],
        [{"custom_id": "x" * 65, "params": params()}],
        [{"custom_id": "no-params"}],
    ]
    for requests in bad:
        with pytest.raises(anthropic.BadRequestError) as refused:
            sdk.messages.batches.create(requests=requests)
        assert refused.value.body["type"] == "error"
        assert refused.value.body["error"]["type"] == "invalid_request_error"
    raw = httpx.post(
        server.url + "/v1/messages/batches",
        content=b"{not json",
        headers={"x-api-key": keys["acme"], "content-type": "application/json"},
    )
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    unauthenticated = httpx.get(server.url + "/v1/messages/batches")
    assert unauthenticated.status_code == 401
    assert unauthenticated.json()["error"]["type"] == "authentication_error"


def test_list_pages_newest_first(server, keys):
    sdk = client(server, keys["beta"])
    made = [sdk.messages.batches.create(requests=[{"custom_id": "a", "params": params(1)}]).id]
    made += [sdk.messages.batches.create(requests=[{"custom_id": "a", "params": params(1)}]).id]
    made += [sdk.messages.batches.create(requests=[{"custom_id": "a", "params": params(1)}]).id]
    first = sdk.messages.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    assert [b.id for b in first] == made[::-1]  # the SDK follows has_more / last_id
    newer = sdk.messages.batches.list(limit=5, before_id=made[0])
    assert [b.id for b in newer.data] == made[:0:-1] and not newer.has_more
    with pytest.raises(anthropic.BadRequestError):
        sdk.messages.batches.list(limit=0)


def test_cancel_then_delete(server, keys):
    sdk = client(server, keys["acme"])
    requests = [{"custom_id": f"long-{i}", "params": params(200, temperature=0)} for i in range(4)]
    batch = sdk.messages.batches.create(requests=requests)
    with pytest.raises(anthropic.BadRequestError):  # still processing: cancel it first
        sdk.messages.batches.delete(batch.id)
    canceling = sdk.messages.batches.cancel(batch.id)
    assert canceling.processing_status in ("canceling", "ended")
    assert canceling.cancel_initiated_at is not None
    done = ended(sdk, batch.id)
    assert done.request_counts.canceled == 4
    assert {r.type for r in results(sdk, batch.id).values()} == {"canceled"}
    deleted = sdk.messages.batches.delete(batch.id)
    assert (deleted.id, deleted.type) == (batch.id, "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError):
        sdk.messages.batches.retrieve(batch.id)


def test_another_tenant_sees_nothing(server, keys):
    owner, other = client(server, keys["acme"]), client(server, keys["beta"])
    batch = owner.messages.batches.create(requests=[{"custom_id": "a", "params": params(1)}])
    ended(owner, batch.id)
    calls = [
        other.messages.batches.retrieve,
        other.messages.batches.cancel,
        other.messages.batches.delete,
        other.messages.batches.results,
    ]
    for call in calls:
        with pytest.raises(anthropic.NotFoundError) as refused:
            call(batch.id)
        assert refused.value.body["error"]["type"] == "not_found_error"
    assert batch.id not in {b.id for b in other.messages.batches.list()}
    assert owner.messages.batches.retrieve(batch.id).processing_status == "ended"


def start_long_batch(server: LiveServer, key: str) -> tuple[str, list[str]]:
    """A batch of 4 lines of 25 tokens (0.5 s each here), once one of them runs."""
    ids = [f"line-{i}" for i in range(4)]
    batch = client(server, key).messages.batches.create(
        requests=[{"custom_id": c, "params": params(25, temperature=0)} for c in ids]
    )
    running = 'zerohop_batch_lines{state="running",tenant="acme"} '

    def lines_running() -> bool:
        for line in httpx.get(server.url + "/metrics").text.splitlines():
            if line.startswith(running) and float(line.split()[-1]) >= 1:
                return True
        return False

    wait_for(lines_running)
    return batch.id, ids


def batches_db(server: LiveServer) -> Path:
    return Path(server.extra_args[server.extra_args.index("--batches-db") + 1])


def test_sigterm_mid_batch_puts_running_lines_back(server, keys):
    batch_id, ids = start_long_batch(server, keys["acme"])
    assert server.stop() == 0
    states = _states(batches_db(server), batch_id)
    # Each line finished during the drain or was given back to waiting: none is lost.
    assert "running" not in states and set(states) <= {"succeeded", "waiting"}
    server.start(server.log_path)
    sdk = client(server, keys["acme"])
    assert ended(sdk, batch_id).request_counts.succeeded == 4
    assert sorted(r.custom_id for r in sdk.messages.batches.results(batch_id)) == ids


def test_kill_9_mid_batch_resumes_with_one_result_each(server, keys):
    batch_id, ids = start_long_batch(server, keys["acme"])
    batch = client(server, keys["acme"]).messages.batches.retrieve(batch_id)
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait()
    left_running = _states(batches_db(server), batch.id).count("running")
    assert left_running >= 1
    server.start(server.log_path)  # the same key store and batch store
    sdk = client(server, keys["acme"])  # kept: a collected client closes its open stream
    assert ended(sdk, batch.id).request_counts.succeeded == 4
    answers = list(sdk.messages.batches.results(batch.id))
    assert sorted(r.custom_id for r in answers) == ids  # each exactly once
    assert {r.result.type for r in answers} == {"succeeded"}
    with sqlite3.connect(batches_db(server)) as conn:
        attempts = [r[0] for r in conn.execute("SELECT attempts FROM lines WHERE batch_id = ?",
                                               (batch.id,))]  # fmt: skip
    assert attempts.count(2) >= left_running  # the lines running at the kill ran again


def _states(db: Path, batch_id: str) -> list[str]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT state FROM lines WHERE batch_id = ?", (batch_id,))
        return [r[0] for r in rows]
