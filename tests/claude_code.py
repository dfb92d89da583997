"""The real Claude Code CLI for tests (issue 38): where `make claude-code` installs it, how it
runs in print mode against a base URL, and a scripted stand-in for the model of an earlier
session.

Claude Code runs with a fresh HOME and CLAUDE_CONFIG_DIR (never the user's config), an
environment of its own (nothing inherited that could pick a model or turn thinking off), and
only harness settings beyond ANTHROPIC_BASE_URL and a key: no telemetry, no non-essential
traffic, no auto-updater, no retries (a refused request fails at once, and the recording
shows the first answer), and a request timeout well under the test's.

Without npm (or node) the test skips with the reason, or fails where
ZEROHOP_REQUIRE_CLAUDE_CODE=1 (set by .ci/run), so CI cannot pass by skipping.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.recording_proxy import BackgroundApp

ROOT = Path(__file__).resolve().parent.parent
CLAUDE = ROOT / ".cache" / "claude-code" / "node_modules" / ".bin" / "claude"
ENSURE = ROOT / "scripts" / "ensure_claude_code.sh"
REQUIRE_ENV = "ZEROHOP_REQUIRE_CLAUDE_CODE"
HARNESS_ENV = {
    "DISABLE_TELEMETRY": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_AUTOUPDATER": "1",
    "CLAUDE_CODE_MAX_RETRIES": "0",
    "API_TIMEOUT_MS": "180000",
}


def require_claude_code() -> Path:
    """The installed `claude` (installing it with `make claude-code`'s script when npm is
    there); skip the test without npm or node (fail it where REQUIRE_ENV=1)."""
    if not CLAUDE.exists() and shutil.which("npm"):
        subprocess.run(["bash", str(ENSURE)], check=False, timeout=600)
    if CLAUDE.exists():
        return CLAUDE
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        reason = f"{' and '.join(missing)} not installed: Claude Code comes from npm"
    else:
        reason = f"{CLAUDE} is missing after `make claude-code` (see its output above)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1)")
    if not missing:
        pytest.fail(reason)
    pytest.skip(reason)


@dataclass
class Run:
    """One `claude -p` run: its exit status, its stream-json events, its stderr."""

    args: list[str]
    returncode: int
    events: list[dict[str, Any]]
    stderr: str
    seconds: float

    @property
    def result(self) -> dict[str, Any]:
        """The final `result` event (the session's outcome)."""
        results = [e for e in self.events if e.get("type") == "result"]
        assert results, f"no result event: {self}"
        return results[-1]

    @property
    def session_id(self) -> str:
        return str(self.result["session_id"])


@dataclass
class ClaudeCode:
    """Claude Code in print mode, in `project` (its working directory), with its own home."""

    home: Path
    project: Path
    api_key: str = "sk-zerohop-test"
    runs: list[Run] = field(default_factory=list)

    def env(self, base_url: str) -> dict[str, str]:
        """The whole environment: nothing of the caller's but PATH."""
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "CLAUDE_CONFIG_DIR": str(self.home / ".claude"),
            "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_API_KEY": self.api_key,
            **HARNESS_ENV,
        }

    def run(self, base_url: str, prompt: str, *args: str, timeout: float = 240) -> Run:
        """`claude -p PROMPT` with stream-json output (one JSON event a line)."""
        cmd = [
            str(CLAUDE), "-p", prompt, "--output-format", "stream-json", "--verbose",
            "--max-turns", "3", "--allowedTools", "Read", *args,
        ]  # fmt: skip
        self.home.mkdir(parents=True, exist_ok=True)
        self.project.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        done = subprocess.run(
            cmd, cwd=self.project, env=self.env(base_url),
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        run = Run(cmd[1:], done.returncode, events, done.stderr, time.monotonic() - started)
        self.runs.append(run)
        return run


def new_session_id() -> str:
    return str(uuid.uuid4())


class EarlierModel(BackgroundApp):
    """A scripted stand-in for the model of an earlier session, so that the session zerohop
    continues holds a real tool call and its result: this model's first turn asks for two
    Read calls (one of a file that is there, one of a file that is not); Claude Code runs
    them itself and sends their results (the second with is_error); the next turn answers
    in text. Claude Code writes the session to its transcript as with any model, and a
    later `--resume` against zerohop sends that conversation. zerohop's own model and
    output are never scripted: this answers only before the base URL changes.

    It keeps the request bodies it got (`requests`): the first one's `model` is Claude
    Code's default model name, which the test serves."""

    def __init__(self, present: Path, absent: Path) -> None:
        super().__init__()
        self.present, self.absent = present, absent
        self.requests: list[dict[str, Any]] = []

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self._messages)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        blocks = self._text() if _has_tool_result(body["messages"]) else self._calls()
        stop = "tool_use" if blocks[0]["type"] == "tool_use" else "end_turn"
        message = {
            "id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": body["model"], "content": blocks, "stop_reason": stop,
            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1},
        }  # fmt: skip
        if not body.get("stream"):
            return web.json_response(message)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for event in _stream_events(message):
            frame = f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
            await response.write(frame.encode())
        await response.write_eof()
        return response

    def _calls(self) -> list[dict[str, Any]]:
        return [
            {"type": "tool_use", "id": f"toolu_{i}{uuid.uuid4().hex[:20]}", "name": "Read",
             "input": {"file_path": str(path)}}
            for i, path in enumerate((self.present, self.absent))
        ]  # fmt: skip

    def _text(self) -> list[dict[str, Any]]:
        text = f"{self.present.name} holds one line; {self.absent.name} does not exist."
        return [{"type": "text", "text": text}]


def _has_tool_result(messages: list[dict[str, Any]]) -> bool:
    last = messages[-1]["content"]
    return isinstance(last, list) and any(b.get("type") == "tool_result" for b in last)


def _stream_events(message: dict[str, Any]) -> list[dict[str, Any]]:
    """`message` as the Messages API streams it (one delta a block)."""
    start = {**message, "content": [], "stop_reason": None}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    for index, block in enumerate(message["content"]):
        if block["type"] == "tool_use":
            empty = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        else:
            empty, delta = (
                {"type": "text", "text": ""},
                {"type": "text_delta", "text": block["text"]},
            )
        events += [
            {"type": "content_block_start", "index": index, "content_block": empty},
            {"type": "content_block_delta", "index": index, "delta": delta},
            {"type": "content_block_stop", "index": index},
        ]
    stop = {"stop_reason": message["stop_reason"], "stop_sequence": None}
    events.append({"type": "message_delta", "delta": stop, "usage": {"output_tokens": 1}})
    events.append({"type": "message_stop"})
    return events
