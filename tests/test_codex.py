"""The real Codex CLI against a live zerohop (issue 39): `codex exec` with a model provider
whose `wire_api` is `responses`, pointed at the server through a recording proxy
(tests/recording_proxy.py), every request and response kept and checked.

The sessions, in one work folder:
0. Against a scripted stand-in for an earlier model (tests/codex.py EarlierResponsesModel)
   that asks for an `exec_command` function call and then an `apply_patch` custom tool
   call; Codex runs both itself (their files appear on disk) and keeps the session. Random
   weights never choose to call a tool (the Claude Code test says why the other ways are
   less honest); this is the real case of a project whose sessions move to zerohop by
   changing the provider's base_url.
1. `codex exec resume --last` of that session against zerohop with a new prompt: zerohop
   gets Codex's whole replayed history (developer and user messages, reasoning with
   encrypted_content, function_call and its output, custom_tool_call and its output, the
   assistant's message with its phase) and answers; Codex completes the turn.
2. A new session with another prompt: its request shares the developer prompt and tools
   with session 1's, and reads them from the prefix cache.

Then the `apply_patch` tool exactly as Codex declared it (its Lark grammar) is forced on
zerohop with the official SDK: the call is a `custom_tool_call` whose input the `lark`
parser accepts. The model is `gpt-5.5`, the catalog entry that makes Codex 0.171 declare
apply_patch as a custom tool; the server serves it under that name.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import lark
import openai
import pydantic
import pytest
from openai.types.responses import ResponseStreamEvent

from tests.codex import MODEL, PATCH_TOOL, Codex, EarlierResponsesModel, Run, require_codex
from tests.fixtures.long_context_model import build_long_context_model
from tests.live_server import LiveServer
from tests.recording_proxy import Exchange, recording
from zerohop.models.default import default_model_path
from zerohop.sse import Parser

pytestmark = pytest.mark.timeout(600)

SERVER_ARGS = ["--max-num-batched-tokens", "65536", "--num-kv-blocks", "8192"]
FIRST_PROMPT = "Write from_shell.txt with the shell, then add hello.txt with apply_patch."
RESUMED_PROMPT = "What does hello.txt say?"
NEW_PROMPT = "List the files in this folder."
SAMPLE_ENV = "ZEROHOP_CODEX_EXCHANGE_DIR"  # where a copy of the recording goes, if set
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
ENDS = ("response.completed", "response.incomplete")


@dataclass
class Sessions:
    earlier: EarlierResponsesModel
    earlier_run: Run
    resumed: Run
    new: Run
    exchanges: list[Exchange]
    server: LiveServer
    workdir: Path
    audit: Path  # the server's audit log

    def audited(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.audit.read_text().splitlines()]

    def requests(self) -> list[dict[str, Any]]:
        return [e.json_body() for e in self.exchanges if e.request_body]


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sessions]:
    """Sessions 0-2, run once for the module's checks; the recording is saved beside."""
    require_codex()
    work = tmp_path_factory.mktemp("codex")
    model = build_long_context_model(work / "model", default_model_path())
    codex = Codex(work / "home", work / "project")
    earlier = EarlierResponsesModel().start()
    try:
        earlier_run = codex.exec(earlier.url, FIRST_PROMPT)
    finally:
        earlier.stop()
    assert earlier_run.succeeded, earlier_run
    audit = ["--audit-dir", str(work / "audit")]
    server = LiveServer(model, [*SERVER_ARGS, *audit], served_model_name=MODEL)
    server.start(work / "server.log")
    try:
        with recording(server.url) as proxy:
            resumed = codex.resume(proxy.url, RESUMED_PROMPT)
            new = codex.exec(proxy.url, NEW_PROMPT)
            record = work / "exchange.jsonl"
            proxy.save(record)
            _save_sample(record)
            yield Sessions(
                earlier, earlier_run, resumed, new, proxy.exchanges, server, codex.workdir,
                work / "audit" / "audit.jsonl",
            )  # fmt: skip
    finally:
        server.stop()


def _save_sample(record: Path) -> None:
    if folder := os.environ.get(SAMPLE_ENV):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / record.name).write_bytes(record.read_bytes())


def events_of(exchange: Exchange) -> list[dict[str, Any]]:
    """The stream's events, each checked against the openai SDK's event types."""
    events = []
    for event in Parser().feed(exchange.response_body):
        if event.data:
            data = json.loads(event.data)
            EVENTS.validate_python(data)
            assert event.name == data["type"].encode(), event
            events.append(data)
    return events


def check_in_order(events: list[dict[str, Any]]) -> list[int]:
    """A Responses stream's events in the API's order (created, in progress, numbered, each
    output item added then done, an end with output tokens); the items' output indexes."""
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ENDS, kinds
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == list(range(len(added))), kinds
    assert events[-1]["response"]["usage"]["output_tokens"] > 0
    return added


def patch_parser(tool: dict[str, Any]) -> lark.Lark:
    """The `lark` parser of a custom tool's grammar. Lark's Earley parser refuses a
    terminal that can match nothing (`/(.*)/`), so those are written as the same language,
    an optional `/(.+)/`."""
    definition = tool["format"]["definition"].replace("/(.*)/", "/(.+)/?")
    return lark.Lark(definition)


def test_the_earlier_session_ran_both_calls(sessions: Sessions) -> None:
    turns = [r.turn for r in sessions.earlier.requests if r.status == 200]
    assert turns == ["exec_command", "apply_patch", "final"]
    folder = sessions.workdir
    assert (folder / EarlierResponsesModel.SHELL_FILE).read_text().strip() == (
        EarlierResponsesModel.SHELL_TEXT
    )
    assert (folder / "hello.txt").read_text() == "hello\n"


def test_no_request_is_refused(sessions: Sessions) -> None:
    assert sessions.exchanges, "Codex sent zerohop nothing"
    summary = [(e.method, e.path, e.status) for e in sessions.exchanges]
    assert all(status == 200 for *_, status in summary), summary
    assert {(m, p) for m, p, _ in summary} == {("POST", "/v1/responses")}


def test_both_sessions_complete(sessions: Sessions) -> None:
    """Each turn completes with zerohop's answer as Codex's message (a random model's answer
    can be blank, which Codex shows as no message)."""
    turns = ((sessions.resumed, sessions.exchanges[0]), (sessions.new, sessions.exchanges[-1]))
    for run, exchange in turns:
        assert run.succeeded, run
        output = events_of(exchange)[-1]["response"]["output"]
        texts = [p["text"] for i in output if i["type"] == "message" for p in i["content"]]
        answer = "".join(texts).strip()
        assert (run.final_message or "").strip() == answer, (run.final_message, answer)


def test_the_resumed_session_sends_its_calls_and_their_outputs(sessions: Sessions) -> None:
    first = sessions.requests()[0]
    assert first["model"] == MODEL and first["store"] is False and first["stream"] is True
    kinds = [item.get("type") for item in first["input"]]
    for kind in (
        "reasoning",
        "function_call",
        "function_call_output",
        "custom_tool_call",
        "custom_tool_call_output",
    ):
        assert kind in kinds, kinds
    [patch_tool] = [t for t in first["tools"] if t.get("name") == PATCH_TOOL]
    assert patch_tool["type"] == "custom" and patch_tool["format"]["syntax"] == "lark"
    [call] = [i for i in first["input"] if i.get("type") == "custom_tool_call"]
    patch_parser(patch_tool).parse(call["input"])
    last = first["input"][-1]
    assert last["role"] == "user" and RESUMED_PROMPT in json.dumps(last["content"])


def test_every_stream_has_the_apis_events_in_order(sessions: Sessions) -> None:
    for exchange in sessions.exchanges:
        events = events_of(exchange)
        added = check_in_order(events)
        assert len(events[-1]["response"]["output"]) == len(added)


def test_the_new_session_reads_the_shared_prefix_from_the_cache(sessions: Sessions) -> None:
    new = sessions.exchanges[-1]
    usage = events_of(new)[-1]["response"]["usage"]
    # The developer prompt and tools (thousands of tokens) come from session 1's blocks.
    assert usage["input_tokens_details"]["cached_tokens"] > usage["input_tokens"] // 2, usage


def test_a_forced_apply_patch_is_a_custom_call_in_its_grammar(sessions: Sessions) -> None:
    """Decoded by the tool's own grammar: every call is a `custom_tool_call` whose input
    streams as decoded, and one that ends is a whole patch. A random model ends a patch in
    about a third of its tries (it writes `*** End Patch` when it happens to), so seeded
    tries go on until one ends; those cut at max_output_tokens are prefixes of a patch."""
    first = sessions.requests()[0]
    [patch_tool] = [t for t in first["tools"] if t.get("name") == PATCH_TOOL]
    client = openai.OpenAI(base_url=sessions.server.url + "/v1", api_key="any", max_retries=0)
    parser = patch_parser(patch_tool)
    for seed in range(1, 9):
        response = client.responses.create(
            model=MODEL, input="Add a file named a.txt.", tools=[patch_tool],
            tool_choice={"type": "custom", "name": PATCH_TOOL}, max_output_tokens=600,
            extra_body={"seed": seed},
        )  # fmt: skip
        [call] = response.output
        assert call.type == "custom_tool_call" and call.name == PATCH_TOOL, response
        assert call.input.startswith("*** Begin Patch\n*** "), call.input[:80]
        if response.status == "completed":
            parser.parse(call.input)  # raises unless a sentence of the grammar
            return
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    pytest.fail("no seeded try ended its patch within max_output_tokens")


def test_the_builtin_provider_works_over_the_websocket(sessions: Sessions, tmp_path: Path) -> None:
    """`openai_base_url` only (issue 51): Codex opens its Responses WebSocket first; the
    upgrade succeeds, so there are no "Reconnecting…" or "Falling back from WebSockets" error
    items, and the server served the turn over the socket."""
    codex = Codex(tmp_path / "home", sessions.workdir, builtin=True)
    run = codex.exec(sessions.server.url, NEW_PROMPT)
    shown = json.dumps(run.events) + run.stderr
    assert "Reconnecting" not in shown and "Falling back from WebSockets" not in shown, run
    assert run.succeeded, run
    metrics = httpx.get(sessions.server.url + "/metrics").text
    served = [line for line in metrics.splitlines() if line.startswith("zerohop_websocket_resp")]
    assert served and float(served[0].split()[-1]) >= 1, served
    over_socket = [r for r in sessions.audited() if r.get("http_version") == "websocket"]
    assert over_socket and all(r["status"] == 200 for r in over_socket), json.dumps(over_socket)


def test_codex_compacts_remotely_when_its_window_fills(sessions: Sessions, tmp_path: Path) -> None:
    """Issue 51: the built-in provider with a window smaller than its prompt (~8k tokens).
    The first turn fills it; before the resumed turn Codex compacts remotely (0.171: its
    remote compaction v2, a streamed create whose input ends with a `compaction_trigger`
    item, answered with exactly one `compaction` item), then runs the turn on the compacted
    history. The server audits the compaction with the summary's tokens."""
    before = len(sessions.audited())
    codex = Codex(tmp_path / "home", tmp_path / "project", builtin=True, window=(8000, 3000))
    first = codex.exec(sessions.server.url, NEW_PROMPT)
    assert first.succeeded, first
    assert not [r for r in sessions.audited()[before:] if r["stop_reason"] == "compaction"]
    resumed = codex.resume(sessions.server.url, RESUMED_PROMPT)
    assert resumed.succeeded and not resumed.items_of("error"), resumed
    compactions = _compactions(sessions, before)
    assert len(compactions) == 1 and compactions[0]["status"] == 200, compactions
    assert compactions[0]["output_tokens"] > 0 and compactions[0]["input_tokens"] > 0


def _compactions(sessions: Sessions, before: int) -> list[dict[str, Any]]:
    """The compaction requests audited since record `before`; the audit log is written in
    the background, so it is read again for a while until one shows."""
    for _ in range(100):
        records = sessions.audited()[before:]
        if found := [r for r in records if r["stop_reason"] == "compaction"]:
            return found
        time.sleep(0.1)
    return []
