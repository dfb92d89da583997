"""The real OpenAI Codex CLI for tests: where `make codex` installs it, how `codex exec` runs
non-interactively against a Responses API base URL, and a scripted stand-in for the model
of an earlier session (`EarlierResponsesModel`).

Codex runs with a fresh CODEX_HOME holding a config.toml this module writes (never the
user's: HOME is fresh too) and an environment of its own (nothing of the caller's but
PATH). The config names one model provider, `zerohop`, with `wire_api = "responses"`, the
key in an environment variable, no retries (a refused request fails at once and the
recording shows the first answer), no WebSockets (the HTTP+SSE transport only), no
analytics, feedback, OpenTelemetry, update checks or plugin sync (with those off it looks
up no host name at all: checked with strace); approvals `never` and the
`workspace-write` sandbox rooted at the work folder, so the model's shell commands and
patches run there and nowhere else.

The model is `gpt-5.5` (MODEL): in Codex 0.171's bundled model catalog it is the model that
gets the classic tool set (`exec_command` and friends as functions) with `apply_patch` as a
`custom` (freeform) tool with a Lark grammar. Names that are not in the catalog (gpt-5,
gpt-5-codex, gpt-5.x-codex, o3, any zerohop name) get fallback metadata without
apply_patch; the gpt-6 / gpt-5.6 entries are `code_mode_only` and "responses lite" (their
tools come as an `additional_tools` input item, not in `tools`).

Without npm (or node) a test skips with the reason, or fails where ZEROHOP_REQUIRE_CODEX=1
(set by .ci/run), so CI cannot pass by skipping.
"""

from __future__ import annotations

import asyncio
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
CODEX = ROOT / ".cache" / "codex" / "node_modules" / ".bin" / "codex"
ENSURE = ROOT / "scripts" / "ensure_codex.sh"
REQUIRE_ENV = "ZEROHOP_REQUIRE_CODEX"
MODEL = "gpt-5.5"
KEY_ENV = "ZEROHOP_API_KEY"
SHELL_TOOL = "exec_command"  # Codex 0.171's shell tool (unified exec) for MODEL
PATCH_TOOL = "apply_patch"


def require_codex() -> Path:
    """The installed `codex` (installing it with `make codex`'s script when npm is there);
    skip the test without npm or node (fail it where REQUIRE_ENV=1)."""
    if not CODEX.exists() and shutil.which("npm"):
        subprocess.run(["bash", str(ENSURE)], check=False, timeout=600)
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if CODEX.exists() and "node" not in missing:  # bin/codex is a Node launcher
        return CODEX
    if missing:
        reason = f"{' and '.join(missing)} not installed: Codex comes from npm"
    else:
        reason = f"{CODEX} is missing after `make codex` (see its output above)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1)")
    if not missing:
        pytest.fail(reason)
    pytest.skip(reason)


def config_toml(base_url: str, model: str = MODEL, idle_timeout_ms: int = 180_000) -> str:
    """The whole config.toml: one provider at `base_url` (without /v1), harness settings.
    Every key is one Codex 0.171 knows (`--strict-config` refuses any other)."""
    return f"""\
model = "{model}"
model_provider = "zerohop"
approval_policy = "never"
sandbox_mode = "workspace-write"
check_for_update_on_startup = false

[sandbox_workspace_write]
network_access = false

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"

# The plugins feature syncs marketplaces at start-up (DNS for github.com, api.github.com and
# chatgpt.com, seen with strace); off, Codex reaches nothing but the provider.
[features]
plugins = false

[model_providers.zerohop]
name = "zerohop"
base_url = "{base_url.rstrip("/")}/v1"
env_key = "{KEY_ENV}"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = {idle_timeout_ms}
supports_websockets = false
"""


def builtin_config_toml(base_url: str, model: str = MODEL) -> str:
    """The config most users write: Codex's built-in `openai` provider pointed at `base_url`
    (`openai_base_url`, nothing else), so Codex opens its Responses WebSocket first."""
    harness = config_toml(base_url, model).split("\n[model_providers.zerohop]")[0]
    harness = harness.replace('model_provider = "zerohop"\n', "")
    return f'openai_base_url = "{base_url.rstrip("/")}/v1"\n{harness}'


@dataclass
class Run:
    """One `codex exec` run: its exit status, its --json events, its stderr."""

    args: list[str]
    returncode: int
    events: list[dict[str, Any]]
    stderr: str
    seconds: float

    @property
    def thread_id(self) -> str:
        """The session's id (`thread.started`), which `resume` takes."""
        started = [e for e in self.events if e.get("type") == "thread.started"]
        assert started, f"no thread.started event: {self}"
        return str(started[0]["thread_id"])

    @property
    def items(self) -> list[dict[str, Any]]:
        """The completed items (agent_message, command_execution, file_change, error, ...)."""
        return [e["item"] for e in self.events if e.get("type") == "item.completed"]

    def items_of(self, kind: str) -> list[dict[str, Any]]:
        return [item for item in self.items if item.get("type") == kind]

    @property
    def final_message(self) -> str | None:
        messages = self.items_of("agent_message")
        return str(messages[-1]["text"]) if messages else None

    @property
    def succeeded(self) -> bool:
        """Exit 0, a completed turn, and no failed turn or error event."""
        kinds = [e.get("type") for e in self.events]
        return (
            self.returncode == 0
            and "turn.completed" in kinds
            and "turn.failed" not in kinds
            and "error" not in kinds
        )


@dataclass
class Codex:
    """`codex exec` in `workdir` (the sandbox's writable root), with its own home."""

    home: Path
    workdir: Path
    api_key: str = "sk-zerohop-test"
    model: str = MODEL
    runs: list[Run] = field(default_factory=list)
    builtin: bool = False  # the built-in `openai` provider (builtin_config_toml)
    # (model_context_window, model_auto_compact_token_limit): a small window makes Codex
    # compact; with the built-in provider it compacts remotely (a `compaction_trigger` item).
    window: tuple[int, int] | None = None

    @property
    def codex_home(self) -> Path:
        return self.home / ".codex"

    def env(self) -> dict[str, str]:
        """The whole environment: nothing of the caller's but PATH."""
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "CODEX_HOME": str(self.codex_home),
            KEY_ENV: self.api_key,
            # The built-in provider's key, for `codex exec` (no `codex login` in the harness).
            **({"CODEX_API_KEY": self.api_key} if self.builtin else {}),
            "LANG": "C.UTF-8",
        }

    def configure(self, base_url: str) -> Path:
        """Write CODEX_HOME/config.toml for `base_url` (each run points it anew)."""
        self.codex_home.mkdir(parents=True, exist_ok=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.codex_home / "config.toml"
        write = builtin_config_toml if self.builtin else config_toml
        text = write(base_url, self.model)
        if self.window is not None:  # top-level keys: before the first table
            size, limit = self.window
            text = (
                f"model_context_window = {size}\nmodel_auto_compact_token_limit = {limit}\n{text}"
            )
        path.write_text(text)
        return path

    def exec(self, base_url: str, prompt: str, *args: str, timeout: float = 240) -> Run:
        """A new session: `codex exec --json PROMPT`."""
        return self._run(base_url, ["exec", *self._common(), *args, prompt], timeout)

    def resume(
        self,
        base_url: str,
        prompt: str,
        *args: str,
        session_id: str | None = None,
        timeout: float = 240,
    ) -> Run:
        """The last session in `workdir` (or `session_id`) with one more prompt:
        `codex exec resume --last --json PROMPT`."""
        target = [session_id] if session_id else ["--last"]
        cmd = ["exec", "resume", *self._common(), *args, *target, prompt]
        return self._run(base_url, cmd, timeout)

    def _common(self) -> list[str]:
        # No -C: `exec resume` has none, and --last picks the newest session of the cwd.
        return ["--json", "--skip-git-repo-check", "--strict-config"]

    def _run(self, base_url: str, args: list[str], timeout: float) -> Run:
        self.configure(base_url)
        cmd = [str(CODEX), *args]
        started = time.monotonic()
        done = subprocess.run(
            cmd, cwd=self.workdir, env=self.env(), stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        run = Run(args, done.returncode, events, done.stderr, time.monotonic() - started)
        self.runs.append(run)
        return run


@dataclass
class Recorded:
    """One request the stand-in got, and what it answered."""

    method: str
    path: str
    headers: dict[str, str]  # names in lower case; authorization redacted
    body: Any  # JSON, or the text when it is not JSON, or None when empty
    status: int = 0
    turn: str = ""  # which scripted turn answered it ("" for a refusal)
    events: list[dict[str, Any]] = field(default_factory=list)  # the SSE events sent

    def as_record(self) -> dict[str, Any]:
        return {
            "method": self.method, "path": self.path, "headers": self.headers,
            "body": self.body, "answer": {
                "status": self.status, "turn": self.turn,
                "events": [e["type"] for e in self.events],
            },
        }  # fmt: skip


SECRET_HEADERS = frozenset({"authorization", "cookie", "openai-api-key", "x-api-key"})


class EarlierResponsesModel(BackgroundApp):
    """A scripted stand-in for the model of an earlier Codex session, streaming the
    Responses API over SSE on `POST /v1/responses`, so that the session zerohop later
    continues holds real tool calls Codex ran itself:

    1. to the prompt: a reasoning item (summary and encrypted_content) and a
       `function_call` of `exec_command` writing SHELL_FILE in the work folder;
    2. after its `function_call_output`: a `custom_tool_call` of `apply_patch` adding
       hello.txt (a freeform patch, streamed as custom_tool_call_input deltas);
    3. after its `custom_tool_call_output`: a final assistant message.
    A user message that comes after those (a resumed session's new prompt) is answered
    with a message too. Anything else (a WebSocket upgrade, another path) is answered
    404 and recorded like the rest, in `requests`.
    """

    SHELL_FILE = "from_shell.txt"
    SHELL_TEXT = "written by exec_command"
    PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello\n*** End Patch\n"
    FINAL_TEXT = "Wrote from_shell.txt with a shell command and hello.txt with apply_patch."
    RESUMED_TEXT = "hello.txt holds one line: hello."

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[Recorded] = []

    @property
    def shell_command(self) -> str:
        return f"printf '%s\\n' '{self.SHELL_TEXT}' > {self.SHELL_FILE} && cat {self.SHELL_FILE}"

    def routes(self, app: web.Application) -> None:
        app.router.add_route("*", "/{tail:.*}", self._any)

    async def _any(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        headers = {
            k.lower(): ("<redacted>" if k.lower() in SECRET_HEADERS else v)
            for k, v in request.headers.items()
        }
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        record = Recorded(request.method, request.path_qs, headers, body)
        self.requests.append(record)
        if request.method != "POST" or request.path != "/v1/responses":
            record.status = 404
            error = {"message": f"no {request.method} {request.path} here", "type": "not_found"}
            return web.json_response({"error": error}, status=404)
        if not isinstance(body, dict) or not body.get("stream"):
            record.status = 400
            error = {"message": "the stand-in streams only", "type": "invalid_request_error"}
            return web.json_response({"error": error}, status=400)
        record.turn, output = self._turn(body.get("input") or [])
        record.events = _stream_events(body, output)
        record.status = 200
        response = web.StreamResponse(
            headers={"content-type": "text/event-stream", "cache-control": "no-cache"}
        )
        await response.prepare(request)
        for event in record.events:
            frame = f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
            await response.write(frame.encode())
            await asyncio.sleep(0)
        await response.write_eof()
        return response

    def _turn(self, items: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
        """Which scripted turn answers `items` (the request's input), and its output items."""
        kinds = [item.get("type") for item in items]
        last = next((k for k in reversed(kinds) if k != "reasoning"), None)
        if last == "custom_tool_call_output":
            return "final", [_message(self.FINAL_TEXT)]
        if last == "function_call_output":
            patch = {
                "id": _id("ctc"), "type": "custom_tool_call", "status": "completed",
                "call_id": _id("call"), "name": PATCH_TOOL, "input": self.PATCH,
            }  # fmt: skip
            return "apply_patch", [patch]
        if "function_call" in kinds or "custom_tool_call" in kinds:
            return "resumed", [_message(self.RESUMED_TEXT)]
        arguments = json.dumps({"cmd": self.shell_command, "yield_time_ms": 2000})
        call = {
            "id": _id("fc"), "type": "function_call", "status": "completed",
            "call_id": _id("call"), "name": SHELL_TOOL, "arguments": arguments,
        }  # fmt: skip
        reasoning = {
            "id": _id("rs"), "type": "reasoning",
            "summary": [{"type": "summary_text", "text": "Write a file with the shell."}],
            "encrypted_content": "c3RhbmQtaW4gcmVhc29uaW5n",  # opaque to the client
        }  # fmt: skip
        return "exec_command", [reasoning, call]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message(text: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "id": _id("msg"), "type": "message", "status": "completed", "role": "assistant",
        "phase": "final_answer", "content": [part],
    }  # fmt: skip


def _chunks(text: str, size: int = 16) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def _stream_events(body: dict[str, Any], output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`output` as the Responses API streams it: response.created and .in_progress, each
    item's added / deltas / done, then response.completed with the whole output."""
    response: dict[str, Any] = {
        "id": _id("resp"), "object": "response", "created_at": int(time.time()),
        "status": "in_progress", "model": body.get("model", MODEL), "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools", []),
        "store": body.get("store", False), "reasoning": body.get("reasoning"),
        "text": body.get("text", {"format": {"type": "text"}}),
        "prompt_cache_key": body.get("prompt_cache_key"), "previous_response_id": None,
        "instructions": body.get("instructions"), "metadata": {}, "error": None,
        "incomplete_details": None, "usage": None, "temperature": 1.0, "top_p": 1.0,
        "truncation": "disabled",
    }  # fmt: skip
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": response},
        {"type": "response.in_progress", "response": response},
    ]
    for index, item in enumerate(output):
        events += _item_events(index, item)
    usage = {
        "input_tokens": 100,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 20, "output_tokens_details": {"reasoning_tokens": 5},
        "total_tokens": 120,
    }  # fmt: skip
    done = {**response, "status": "completed", "output": output, "usage": usage,
            "completed_at": int(time.time())}  # fmt: skip
    events.append({"type": "response.completed", "response": done})
    return [{**event, "sequence_number": n} for n, event in enumerate(events)]


def _item_events(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    """One output item's events, from output_item.added to output_item.done."""
    at = {"output_index": index, "item_id": item["id"]}
    kind = item["type"]
    events: list[dict[str, Any]] = []
    if kind == "reasoning":
        added = {**item, "summary": [], "encrypted_content": None}
        events.append({"type": "response.output_item.added", "output_index": index, "item": added})
        for s, summary in enumerate(item["summary"]):
            empty = {"type": "summary_text", "text": ""}
            events.append(
                {"type": "response.reasoning_summary_part.added", **at, "summary_index": s,
                 "part": empty}
            )  # fmt: skip
            for delta in _chunks(summary["text"]):
                events.append(
                    {"type": "response.reasoning_summary_text.delta", **at, "summary_index": s,
                     "delta": delta}
                )  # fmt: skip
            events.append(
                {"type": "response.reasoning_summary_text.done", **at, "summary_index": s,
                 "text": summary["text"]}
            )  # fmt: skip
            events.append(
                {"type": "response.reasoning_summary_part.done", **at, "summary_index": s,
                 "part": summary}
            )  # fmt: skip
    elif kind == "function_call":
        added = {**item, "status": "in_progress", "arguments": ""}
        events.append({"type": "response.output_item.added", "output_index": index, "item": added})
        for delta in _chunks(item["arguments"]):
            events.append({"type": "response.function_call_arguments.delta", **at, "delta": delta})
        events.append(
            {"type": "response.function_call_arguments.done", **at, "arguments": item["arguments"]}
        )
    elif kind == "custom_tool_call":
        added = {**item, "status": "in_progress", "input": ""}
        events.append({"type": "response.output_item.added", "output_index": index, "item": added})
        for delta in _chunks(item["input"]):
            events.append({"type": "response.custom_tool_call_input.delta", **at, "delta": delta})
        events.append(
            {"type": "response.custom_tool_call_input.done", **at, "input": item["input"]}
        )
    elif kind == "message":
        added = {**item, "status": "in_progress", "content": []}
        events.append({"type": "response.output_item.added", "output_index": index, "item": added})
        for c, part in enumerate(item["content"]):
            at_part = {**at, "content_index": c}
            empty = {**part, "text": ""}
            events.append({"type": "response.content_part.added", **at_part, "part": empty})
            for delta in _chunks(part["text"]):
                events.append(
                    {"type": "response.output_text.delta", **at_part, "delta": delta,
                     "logprobs": []}
                )  # fmt: skip
            events.append(
                {"type": "response.output_text.done", **at_part, "text": part["text"],
                 "logprobs": []}
            )  # fmt: skip
            events.append({"type": "response.content_part.done", **at_part, "part": part})
    else:
        raise ValueError(f"no events for a {kind} item")
    events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    return events
