"""WebSocket mode on `/v1/responses` (issue 51) against a live server: the openai SDK's
`responses.connect()` runs several responses over one socket, chains them by
`previous_response_id` with `store: false`, warms up with `generate: false`, and gets the API's
`error` events for bad messages without losing the socket; the upgrade is refused (HTTP 401
with the API's error body) without a key; each response is one audited request
(`http_version` "websocket"); a message over the body limit closes with 1009, and a draining
server closes an idle socket with 1001. On a server of their own: lanes (`stream_id`) run side
by side, `--ws-idle-seconds` closes a silent socket (never one mid-response), and a trusted
front's end user is audited; the `--ws-*` flags are checked where they enter. (Codex over the
socket: test_codex.py; the Agents SDK's websocket transport: test_agents_websocket.py.)
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


# -- lanes, the idle timeout, the trusted front (a server of their own) --------------------

IDLE = 0.15  # --ws-idle-seconds of the fronted server
STEP = 0.01  # --debug-step-delay of the fronted server: the long response takes LONG steps
LONG = 60  # output tokens of a response that outlasts IDLE: LONG * STEP > 2 * IDLE


@pytest.fixture(scope="module")
def fronted(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A server behind a trusted front (the test client's own address), open to any key,
    whose sockets close after IDLE seconds of silence."""
    log = tmp_path_factory.mktemp("ws_fronted") / "server.log"
    audit = log.parent / "audit"
    args = ["--trusted-front", "127.0.0.1", "--ws-idle-seconds", str(IDLE)]
    args += ["--debug-step-delay", str(STEP)]
    server = LiveServer(llama_dir, [*args, "--audit-dir", str(audit), "--drain-seconds", "3"])
    yield {"server": server.start(log), "audit": audit}
    server.stop()


def test_lanes_run_side_by_side_idle_closes_and_the_front_names_the_user(
    fronted: dict[str, Any],
) -> None:
    asyncio.run(_lanes_idle_and_front(fronted))


async def _lanes_idle_and_front(fronted: dict[str, Any]) -> None:
    """A long response on lane "long", a short one on "short" sent after it: the short one
    finishes first (the lanes run side by side). Once it has, a new lane forks from it (not
    stored) and another names a model that is not served (its `error` event carries its
    lane), while the long one still runs. Every event carries its lane and each lane's
    sequence numbers count from 0. The long response outlasts the idle timeout and is not
    cut; then the silent socket is closed with 1000. The upgrade's end-user header (from a
    trusted front) is the audit's end user of every response."""
    headers = {"x-claude-gateway-user-id": "alice@ws"}
    base = {"type": "response.create", "model": MODEL_NAME, "temperature": 0, "store": False}
    lanes: dict[str, list[dict[str, Any]]] = {}
    finished: list[str] = []
    async with connect(ws_url(fronted), additional_headers=headers) as ws:
        started = time.monotonic()
        for lane, text, tokens in (("long", "Tell a long story.", LONG), ("short", "hi", 4)):
            create = {**base, "input": text, "max_output_tokens": tokens}
            await ws.send(json.dumps({**create, "stream_id": lane}))
        while len(finished) < 4:
            event = json.loads(await ws.recv())
            lane = event["stream_id"]
            lanes.setdefault(lane, []).append(event)
            if event["type"] not in ("response.completed", "response.incomplete", "error"):
                continue
            finished.append(lane)
            if lane == "short":
                short = event["response"]["id"]
                fork = {**base, "input": "go on", "max_output_tokens": 4}
                await ws.send(
                    json.dumps({**fork, "previous_response_id": short, "stream_id": "fork"})
                )
                await ws.send(json.dumps({**base, "model": "no-such-model", "stream_id": "bad"}))
        took = time.monotonic() - started
        assert finished[0] == "short" and finished[-1] == "long", finished
        assert took > 2 * IDLE, f"the long response took {took:.2f} s: too short for the test"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000
        assert closed.value.rcvd.reason == f"idle for {IDLE:g} seconds"
    for lane in ("long", "short", "fork"):
        events = lanes[lane]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    assert lanes["long"][-1]["response"]["usage"]["output_tokens"] == LONG  # not cut short
    assert lanes["fork"][-1]["response"]["previous_response_id"] == short
    [bad] = lanes["bad"]
    assert (bad["type"], bad["status"]) == ("error", 404), bad
    records = [
        r for r in audit_records(fronted["audit"], 4) if r.get("http_version") == "websocket"
    ]
    seen = sorted((r["status"], r.get("end_user")) for r in records)
    assert seen == [(200, "alice@ws")] * 3 + [(404, "alice@ws")], records


def test_the_socket_limits_are_checked_where_they_enter(capsys: pytest.CaptureFixture[str]) -> None:
    """`--ws-idle-seconds` and `--ws-max-queued` reach SocketLimits; zero or a word is the
    parser's one-line refusal, and SocketLimits refuses them too."""
    from zerohop.api.http.websocket import SocketLimits
    from zerohop.cli import build_parser

    args = build_parser().parse_args(["serve", "tiny", "--ws-idle-seconds", "2.5"])
    assert (args.ws_idle_seconds, args.ws_max_queued) == (2.5, 16)
    for flag, value in [
        ("--ws-idle-seconds", "0"),
        ("--ws-max-queued", "0"),
        ("--ws-max-queued", "x"),
    ]:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "tiny", flag, value])
        assert f"argument {flag}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="idle timeout"):
        SocketLimits(idle_timeout=0)
    with pytest.raises(ValueError, match="read-ahead"):
        SocketLimits(max_pending=0)
