"""The real Claude Code CLI against a live zerohop (issue 38): print mode, pointed at the
server with ANTHROPIC_BASE_URL and a key, thinking on and its default model name (the name
the server serves is the one Claude Code sends), every request and response recorded on
the wire by a proxy (tests/recording_proxy.py) and checked.

The sessions:
0. Against a scripted stand-in for an earlier model (tests/claude_code.py EarlierModel),
   which asks for two Read calls; Claude Code runs them itself (one file is there, one is
   not: its result has is_error) and writes the session to its transcript. Random weights
   never choose to call a tool, and the other ways weighed were less honest: a transcript
   written by hand for `--resume` (Claude Code's format is undocumented, ~30 entry kinds in
   2.1.332, and the tool results would be ours, not its own); `--json-schema` (it adds a
   StructuredOutput tool, but under tool_choice auto, so a random model still never calls
   it); stream-json input (a host sends user turns, never an assistant's tool_use); weights
   built to write a `<tool_call>` (scripting the served model's output). This is the real
   case of a project whose sessions move to zerohop by changing ANTHROPIC_BASE_URL.
1. `--resume` of that session against zerohop with a new question: the server gets the
   conversation with its tool_use and tool_result blocks, and answers.
2. A new session with another question: its first request shares the system prompt and
   tools with session 1's, and reads them from the prefix cache.

The model (tests/fixtures/long_context_model.py) has a 64k context: Claude Code's prompt
is ~12-21k tokens in SmolLM2's tokenizer, and it asks for max_tokens 128000.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.claude_code import ClaudeCode, EarlierModel, Run, new_session_id, require_claude_code
from tests.fixtures.long_context_model import build_long_context_model
from tests.live_server import LiveServer
from tests.messages_stream import Stream, check_stream
from tests.recording_proxy import Exchange, recording
from zerohop.models.default import default_model_path

pytestmark = pytest.mark.timeout(600)

# One thread, as every live test here; one prefill step takes a whole prompt (the first
# chunk of a long prompt is the fast causal path); room for two sessions' prompts.
SERVER_ARGS = ["--max-num-batched-tokens", "65536", "--num-kv-blocks", "8192"]
BLOCK_SIZE = 16  # the engine's default: the cache is read in whole blocks
FIRST_PROMPT = "Read notes.txt and missing.txt."
RESUMED_QUESTION = "What did notes.txt say?"
NEW_QUESTION = "List the files in this folder."
SAMPLE_ENV = "ZEROHOP_CLAUDE_EXCHANGE_DIR"  # where a copy of the recording goes, if set


@dataclass
class Sessions:
    earlier: Run
    earlier_requests: list[dict[str, Any]]
    resumed: Run
    new: Run
    exchanges: list[Exchange]
    server: LiveServer
    record: Path

    def of(self, run: Run) -> list[Exchange]:
        """The exchanges of `run`'s session (Claude Code names it in a header)."""
        sid = run.session_id
        return [
            e for e in self.exchanges if e.request_headers.get("x-claude-code-session-id") == sid
        ]

    def streams(self) -> list[tuple[Exchange, Stream]]:
        return [(e, check_stream(e.response_body)) for e in self.exchanges if e.is_stream]


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sessions]:
    """Sessions 0-2, run once for the module's checks; the recording is saved beside."""
    require_claude_code()
    work = tmp_path_factory.mktemp("claude_code")
    model = build_long_context_model(work / "model", default_model_path())
    claude = ClaudeCode(work / "home", work / "project")
    earlier, earlier_run, sid = _earlier_session(claude)
    served_name = earlier.requests[0]["model"]  # Claude Code's default model
    server = LiveServer(model, SERVER_ARGS, served_model_name=served_name)
    server.start(work / "server.log")
    try:
        with recording(server.url) as proxy:
            resumed = claude.run(proxy.url, RESUMED_QUESTION, "--resume", sid)
            new = claude.run(proxy.url, NEW_QUESTION)
            record = work / "exchange.jsonl"
            proxy.save(record)
            _save_sample(record)
            yield Sessions(
                earlier_run, earlier.requests, resumed, new, proxy.exchanges, server, record
            )
    finally:
        server.stop()


def _earlier_session(claude: ClaudeCode) -> tuple[EarlierModel, Run, str]:
    """Session 0, against the scripted earlier model: two Read calls and their results."""
    claude.project.mkdir(parents=True, exist_ok=True)
    present, absent = claude.project / "notes.txt", claude.project / "missing.txt"
    present.write_text("zerohop serves the Anthropic Messages API.\n")
    earlier = EarlierModel(present, absent).start()
    sid = new_session_id()
    try:
        run = claude.run(earlier.url, FIRST_PROMPT, "--session-id", sid)
    finally:
        earlier.stop()
    assert run.returncode == 0 and not run.result["is_error"], run
    return earlier, run, sid


def _save_sample(record: Path) -> None:
    """A copy of the recording where SAMPLE_ENV says (for a person to read)."""
    if folder := os.environ.get(SAMPLE_ENV):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / record.name).write_bytes(record.read_bytes())


def _blocks(request: dict[str, Any], role: str, kind: str) -> list[dict[str, Any]]:
    return [
        block
        for message in request["messages"]
        if message["role"] == role and isinstance(message["content"], list)
        for block in message["content"]
        if block.get("type") == kind
    ]


def _summary(exchanges: list[Exchange]) -> str:
    """Each exchange in a line: path, status, and the error body of a refusal."""
    lines = []
    for e in exchanges:
        error = e.response_body[:300].decode(errors="replace") if e.status >= 400 else ""
        lines.append(f"{e.method} {e.path} -> {e.status} {error}")
    return "\n".join(lines)


def test_the_earlier_session_ran_both_tool_calls(sessions: Sessions) -> None:
    """Claude Code itself ran the Reads the earlier model asked for: one result, one error."""
    last = sessions.earlier_requests[-1]
    uses = _blocks(last, "assistant", "tool_use")
    results = _blocks(last, "user", "tool_result")
    assert [u["name"] for u in uses] == ["Read", "Read"]
    assert {r["tool_use_id"] for r in results} == {u["id"] for u in uses}
    assert sorted(bool(r.get("is_error")) for r in results) == [False, True], results


def test_the_resumed_session_sends_the_tool_call_and_its_results(sessions: Sessions) -> None:
    """What zerohop is asked to continue: the earlier turns, tool blocks included."""
    exchanges = sessions.of(sessions.resumed)
    assert exchanges, _summary(sessions.exchanges)
    first = exchanges[0].json_body()
    uses = _blocks(first, "assistant", "tool_use")
    results = _blocks(first, "user", "tool_result")
    assert [u["name"] for u in uses] == ["Read", "Read"], first["messages"]
    assert {r["tool_use_id"] for r in results} == {u["id"] for u in uses}
    assert any(r.get("is_error") for r in results), results
    assert first["model"] == sessions.earlier_requests[0]["model"]
    assert first.get("thinking", {}).get("type") not in (None, "disabled"), first.get("thinking")


def test_no_request_is_refused(sessions: Sessions) -> None:
    """Every request of both zerohop sessions answered 2xx (Claude Code retries nothing:
    CLAUDE_CODE_MAX_RETRIES=0, so a refusal would show here)."""
    assert sessions.exchanges, "Claude Code sent nothing"
    refused = [e for e in sessions.exchanges if e.status >= 400]
    assert not refused, _summary(refused)


def test_both_sessions_complete(sessions: Sessions) -> None:
    """Claude Code ends each session as a success, with the server's answer as its result."""
    for run in (sessions.resumed, sessions.new):
        result = run.result
        assert run.returncode == 0, (run.stderr[-2000:], result)
        assert result["subtype"] == "success" and not result["is_error"], result
        assert result.get("api_error_status") is None, result


def test_every_stream_is_well_formed(sessions: Sessions) -> None:
    """Each session's answers came as Messages SSE streams that a strict reader accepts."""
    for run in (sessions.resumed, sessions.new):
        streamed = [e for e in sessions.of(run) if e.is_stream]
        assert streamed, f"no stream in session {run.session_id}:\n{_summary(sessions.of(run))}"
        for exchange in streamed:
            stream = check_stream(exchange.response_body)
            assert stream.stop_reason in ("end_turn", "max_tokens", "tool_use"), stream
            assert stream.usage.get("output_tokens", 0) >= 1, stream


def test_the_new_session_reads_the_shared_prefix_from_the_cache(sessions: Sessions) -> None:
    """The second session's first request reads the system prompt and tools it shares with
    the first session from the prefix cache: cache_read_input_tokens is about their length
    (the shared part's token count, less the last partial block)."""
    first = sessions.of(sessions.new)[0]
    assert first.status == 200, _summary([first])
    usage = check_stream(first.response_body).usage
    shared = _shared_prompt_tokens(sessions.server, first)
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert shared - 2 * BLOCK_SIZE <= usage["cache_read_input_tokens"] <= prompt, (shared, usage)


def _shared_prompt_tokens(server: LiveServer, exchange: Exchange) -> int:
    """The tokens of `exchange`'s system prompt and tools: the server's count of the same
    request with a one-word conversation, less that conversation's own few tokens."""
    body = exchange.json_body()
    probe = {"model": body["model"], "system": body["system"], "tools": body["tools"]}
    headers = {k: v for k, v in exchange.request_headers.items() if k.startswith("anthropic-")}

    def count(messages: list[dict[str, Any]]) -> int:
        response = httpx.post(
            server.url + "/v1/messages/count_tokens",
            json={**probe, "messages": messages},
            headers=headers,
            timeout=60,
        )
        assert response.status_code == 200, response.text
        return int(response.json()["input_tokens"])

    word = [{"role": "user", "content": "Hi"}]
    return count(word) - 10  # "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_report(sessions: Sessions) -> None:
    """Not a check: what Claude Code sent, for the log (pytest -s) and the issue."""
    first = (sessions.of(sessions.resumed) or sessions.exchanges)[0]
    body = first.json_body()
    runs = (sessions.earlier, sessions.resumed, sessions.new)
    report = {
        "recording": str(sessions.record),
        "exchanges": _summary(sessions.exchanges).splitlines(),
        "first_request_fields": sorted(body),
        "tools": len(body.get("tools", [])),
        "anthropic_beta": first.request_headers.get("anthropic-beta"),
        "seconds": [round(r.seconds, 1) for r in runs],
    }
    print(json.dumps(report, indent=2))
