"""WebSocket mode on `/v1/responses` (issue 51) against a live server: the openai SDK's
`responses.connect()` runs several responses over one socket, chains them by
`previous_response_id` with `store: false`, warms up with `generate: false`, and gets the API's
`error` events for bad messages without losing the socket; the upgrade is refused (HTTP 401
with the API's error body) without a key; each response is one audited request
(`http_version` "websocket"); a message over the body limit closes with 1009, and a draining
server closes an idle socket with 1001. (Codex over the socket: test_codex.py.)
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import websockets
from websockets.asyncio.client import connect

from tests.live_server import MODEL_NAME, LiveServer
from zerohop.gateway.store.sqlite import KeyStore

pytestmark = pytest.mark.server
MAX_BODY = 65536


@pytest.fixture(scope="module")
def keyed(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    db = tmp_path_factory.mktemp("ws_keys") / "keys.db"
    store = KeyStore(db)
    key = store.create_key("acme")[0]
    store.close()
    log = tmp_path_factory.mktemp("ws_server") / "server.log"
    audit = log.parent / "audit"
    args = ["--keys-db", str(db), "--audit-dir", str(audit), "--max-body-bytes", str(MAX_BODY)]
    server = LiveServer(llama_dir, args).start(log)
    yield {"server": server, "key": key, "audit": audit}
    server.stop()


def ws_url(keyed: dict[str, Any]) -> str:
    return keyed["server"].url.replace("http://", "ws://") + "/v1/responses"


async def events_until_done(connection: Any) -> list[Any]:
    """A response's events, up to its terminal one (or an `error` event)."""
    events = []
    async for event in connection:
        events.append(event)
        if event.type in ("response.completed", "response.incomplete", "response.failed", "error"):
            return events
    raise AssertionError(f"the socket closed after {[e.type for e in events]}")


def audit_records(directory: Path, want: int) -> list[dict[str, Any]]:
    """The audit's records once `want` of them are written (the log is flushed behind)."""
    records: list[dict[str, Any]] = []
    for _ in range(200):
        path = directory / "audit.jsonl"
        data = path.read_bytes() if path.exists() else b""
        records = [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]
        if len(records) >= want:
            break
        time.sleep(0.05)
    return records


def test_the_sdk_runs_chained_responses_and_errors_over_one_socket(keyed: dict[str, Any]) -> None:
    asyncio.run(_the_sdk_runs_chained_responses_and_errors_over_one_socket(keyed))


async def _the_sdk_runs_chained_responses_and_errors_over_one_socket(
    keyed: dict[str, Any],
) -> None:
    client = openai.AsyncOpenAI(
        base_url=keyed["server"].url + "/v1", api_key=keyed["key"], max_retries=0
    )
    base = {"model": MODEL_NAME, "store": False, "max_output_tokens": 4, "temperature": 0}
    async with client.responses.connect() as connection:
        await connection.response.create(**base, input="Name a colour.")
        first = await events_until_done(connection)
        kinds = [e.type for e in first]
        assert kinds[:2] == ["response.created", "response.in_progress"], kinds
        assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
        done = first[-1].response
        assert done.store is False and done.usage.output_tokens > 0
        assert [e.sequence_number for e in first] == list(range(len(first)))

        # Not stored, yet the socket's last response continues: its turns are in the prompt.
        await connection.response.create(**base, input="And another?", previous_response_id=done.id)
        second = (await events_until_done(connection))[-1]
        assert second.type in ("response.completed", "response.incomplete"), second
        assert second.response.previous_response_id == done.id
        assert second.response.usage.input_tokens > done.usage.input_tokens

        # A warm-up (Codex's `generate: false`): the response, no output, chainable.
        await connection.send({"type": "response.create", **base, "input": "hi", "generate": False})
        warm = (await events_until_done(connection))[-1]
        assert warm.type == "response.completed" and warm.response.output == []
        await connection.response.create(**base, input="go", previous_response_id=warm.response.id)
        assert (await events_until_done(connection))[-1].type != "error"

        # Bad messages get the API's error event, and the socket stays usable.
        await connection.send({"type": "response.cancel_everything"})  # type: ignore[arg-type]
        unknown = (await events_until_done(connection))[-1]
        assert unknown.type == "error" and unknown.status == 400
        assert unknown.error.type == "invalid_request_error" and unknown.error.param == "type"
        await connection.response.create(**base, input="x", previous_response_id="resp_nope")
        missing = (await events_until_done(connection))[-1]
        assert missing.type == "error" and missing.status == 404
        assert missing.error.code == "previous_response_not_found"
        await connection.response.create(**{**base, "model": "no-such-model"}, input="x")
        assert (await events_until_done(connection))[-1].status == 404

        # The socket still serves after the errors.
        await connection.response.create(**base, input="Last one.")
        last = (await events_until_done(connection))[-1].type
        assert last in ("response.completed", "response.incomplete"), last

    # Each response.create is one audited request over the socket; errors are recorded too.
    records = audit_records(keyed["audit"], 8)
    socket_records = [r for r in records if r.get("http_version") == "websocket"]
    statuses = sorted(r["status"] for r in socket_records)
    assert statuses == [200, 200, 200, 200, 200, 404, 404], records
    assert {r["tenant"] for r in socket_records} == {"acme"}


def test_the_upgrade_is_refused_without_a_key_and_on_other_paths(keyed: dict[str, Any]) -> None:
    asyncio.run(_the_upgrade_is_refused_without_a_key_and_on_other_paths(keyed))


async def _the_upgrade_is_refused_without_a_key_and_on_other_paths(
    keyed: dict[str, Any],
) -> None:
    url = ws_url(keyed)
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with connect(url, additional_headers={"Authorization": "Bearer sk-wrong"}):
            pass
    response = refused.value.response
    assert response.status_code == 401
    assert json.loads(response.body)["error"]["type"] == "authentication_error"
    with pytest.raises(websockets.InvalidStatus) as other:
        async with connect(url.replace("/v1/responses", "/v1/chat/completions")):
            pass
    assert other.value.response.status_code == 404


def test_limits_close_the_socket_cleanly(keyed: dict[str, Any]) -> None:
    asyncio.run(_limits_close_the_socket_cleanly(keyed))


async def _limits_close_the_socket_cleanly(keyed: dict[str, Any]) -> None:
    """Over the message limit: 1009. The server draining: an idle socket closes with 1001.
    (Last in this module: it stops the server.)"""
    headers = {"Authorization": f"Bearer {keyed['key']}"}
    async with connect(ws_url(keyed), additional_headers=headers, max_size=None) as ws:
        await ws.send("x" * (MAX_BODY + 1))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009

    async with connect(ws_url(keyed), additional_headers=headers) as ws:
        await ws.send(json.dumps({"type": "response.create", "model": MODEL_NAME, "input": "hi"}))
        while json.loads(await ws.recv())["type"] not in (
            "response.completed",
            "response.incomplete",
        ):
            pass
        keyed["server"].process.send_signal(signal.SIGTERM)
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 60)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
