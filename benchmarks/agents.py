"""A scripted coding-agent session through the Anthropic Messages API (issue 38): one
`zerohop serve`, the official `anthropic` SDK, streamed, --turns (10) turns of one conversation
with a Claude Code-sized system prompt and 22 tools (benchmarks/_agent_prompt.py: text and
schemas written for this benchmark, seeded, the same every run).

Every turn appends the previous answer and a new user message, as an agent does; on every
--forced-every'th (3rd) turn the request forces a tool call (`tool_choice: {"type": "tool",
"name": ...}`: Read, Grep, TodoWrite, ...), its input is checked against the tool's schema
with jsonschema, and the next user message carries its tool_result (so does any call the
model makes by itself). Temperature 0; answers --max-tokens (64), forced calls
--tool-max-tokens (256).

Per turn:
  prompt      input_tokens + cache_read_input_tokens (the final message's usage)
  cached      cache_read_input_tokens: read from the prefix cache
  recomputed  input_tokens: the part of the prompt prefilled this turn
  new         prompt tokens added since the previous turn's prompt (the previous answer, the
              tool_result if any, the new user message); turn 1: its whole prompt
  unseen      new less the previous answer's output tokens: what the server has neither
              prefilled nor generated (the answer's own tokens may still be in its cache)
  ttft        client side: from calling the SDK to the first content_block_delta event (an
              answer with none, an end_turn at once: to its message_delta, marked *)
  server ttft the server's send time of the write holding the first content_block_delta
              (request header `zerohop-send-times: 1`: an SSE comment `: zerohop-sent T`
              before each write, read by a tee in the SDK's HTTP transport), less the
              client's send time (same machine, same clock)
  msg start   client side: to the message_start event, which the server sends with the
              engine's first delta: the end of the first prefill chunk (of at most
              --max-num-batched-tokens, 2048), so on a warm turn the first token, forced
              call or not; on the cold turn 1 long before its first token
  total       from calling the SDK to the end of the stream
Summary over the warm turns (2..N; turn 1 fills the cache and is reported on its own): the
least-squares slope against new tokens (ms per new token) and the correlations with new tokens
and with the whole prompt's length (the target: TTFT follows the new tokens, not the prompt),
of TTFT on the turns that answer in text (a forced call's first delta waits for the decode of
the call's opening, `{"name": ...`, so those turns are summarized apart) and of the time to
message_start on all of them; sum(recomputed) / sum(new) (target ~1; new counts the previous
answer, which the server generated and usually still caches, so recomputed / unseen is the
stricter one); forced calls valid / forced (target 100%).

The same session through the OpenAI Responses API (POST /v1/responses, streamed, raw HTTP as
Codex sends it, the SSE read with zerohop.bench.probe_sse), two ways, each on a fresh server of
its own (--surfaces; a fresh key store in a temporary folder): `replay` sends the whole
conversation as `input` items every turn with `store: false` (as Codex does); `chain` sends
only the items since the last response (the function_call_output items, the new user message)
with `previous_response_id` and `store: true`. The system prompt is `instructions`, the tools
are the same 22 as function tools (sent on every request: the API carries neither over), a
forced call is `tool_choice: {"type": "function", "name": ...}`, an empty answer goes back as
an assistant message `(no answer)` in both modes. Per turn, beside the columns above (prompt
= usage.input_tokens, cached = input_tokens_details.cached_tokens, recomputed = prompt less
cached, from the final response.completed / response.incomplete event):
  ttft        to the first response.output_item.added or response.output_text.delta (an
              answer with neither: to its final event, marked *); srv ttft as above
  created     to response.created (sent once the engine admits the request, as message_start;
              `chain` reads the previous response from the store before it), and the server's
              send time of it less the client's send time
  final gap   the server's send time of the final event's write less that of the write before
              it: the last engine step, and for `chain` the store's write of the response
  get         `chain`: a GET /v1/responses/{id} round trip after the turn
  items, KiB  the request's input items and body size
Summary: the figures above per mode, and chain less replay of the warm medians of created,
server created, final gap and total: what the store (and sending less) adds per response.

The prompt: --prefix-tokens (13,000) of system prompt and tools, as the server counts them,
cut to what leaves room in the model's context for max(--turns, --fit-turns (10)) turns. The
default model (SmolLM2-135M-Instruct) has 8,192 positions: a 10-turn session then gets a
~6k-token prefix (the tools and the template alone are ~3.4k), smaller than Claude Code's
(~12-21k in this tokenizer); the program says so when it cuts. For the full size,
`--model long-context` builds (once, into ~/.cache/zerohop/bench-models/) the 64k-context
protocol-test model of tests/fixtures/long_context_model.py: random weights, 2 layers, the
default model's tokenizer; its TTFT figures are the engine's, its answers noise.

    .venv/bin/python benchmarks/agents.py                      # default model, 10 turns
    .venv/bin/python benchmarks/agents.py --turns 3            # smoke
    .venv/bin/python benchmarks/agents.py --model long-context # a 13k-token prefix
    .venv/bin/python benchmarks/agents.py --surfaces replay,chain  # the Responses API only

Prints the per-turn table and the summary (rich) and writes bench-results/agents.json (--out):
every turn, the summary, the prompt's sizes and the environment (CPUs, load averages, model,
flags, versions, server command) and, under "responses", each mode's turns, summary, server
command and log, and "chain_minus_replay_ms"; the servers' logs are
bench-results/agents-server.log and agents-server-{replay,chain}.log.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import jsonschema
from _agent_prompt import (
    SCHEMAS,
    TOOLS,
    forced_tool,
    system_prompt,
    tool_result,
    user_turn,
)
from _common import ROOT, cpu_count, model_path, open_model, write_json
from harness.zerohop_server import ZerohopServer
from rich.console import Console
from rich.table import Table

from zerohop.bench.probe_sse import SseEvent, SseReader

SERVED_MODEL_NAME = "agents-bench"
LONG_CONTEXT = "long-context"
LONG_CONTEXT_DIR = Path.home() / ".cache" / "zerohop" / "bench-models" / "long-context-64k"
SEND_TIMES_HEADER = "zerohop-send-times"
STAMP = b": zerohop-sent "
# Per message, the chat template's own tokens (role markers, separators) and a margin for a
# re-tokenized answer: the room kept for each turn when sizing the prefix.
TURN_OVERHEAD = 24
MARGIN = 64
# An empty answer goes back as this text: the API takes no empty text block or content.
PLACEHOLDER = {"type": "text", "text": "(no answer)"}
# The Responses API: `replay` (store: false, the whole conversation each turn) and `chain`
# (store: true, the new items with previous_response_id); each runs on a server of its own.
RESPONSES_PATH = "/v1/responses"
MODES = ("replay", "chain")
SURFACES = ("anthropic", *MODES)
FIRST_OUTPUT = ("response.output_item.added", "response.output_text.delta")
FINAL = ("response.completed", "response.incomplete")
FAILED = ("response.failed", "error")
PLACEHOLDER_ITEM = {
    "type": "message",
    "role": "assistant",
    "content": [{"type": "output_text", "text": PLACEHOLDER["text"]}],
}
RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": t["name"],
        "description": t["description"],
        "parameters": t["input_schema"],
    }
    for t in TOOLS
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model",
        default=None,
        help=f"default: zerohop's default model; '{LONG_CONTEXT}': the 64k test model",
    )
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--prefix-tokens", type=int, default=13_000, help="system prompt + tools")
    p.add_argument("--max-tokens", type=int, default=64, help="an answer's max_tokens")
    p.add_argument("--tool-max-tokens", type=int, default=256, help="a forced call's max_tokens")
    p.add_argument("--fit-turns", type=int, default=10, help="size the prefix for at least N turns")
    p.add_argument("--forced-every", type=int, default=3, help="force a call every N turns")
    p.add_argument("--threads", type=int, default=2, help="engine threads")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--surfaces",
        type=surfaces,
        default=list(SURFACES),
        help="sessions to run, comma-separated, each on a fresh server (default: all):"
        " anthropic (Messages), replay (Responses, store: false, the whole conversation),"
        " chain (Responses, store: true, previous_response_id)",
    )
    p.add_argument("--zerohop-args", default="", help="more `zerohop serve` flags (one string)")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "agents.json")
    return p.parse_args()


def surfaces(given: str) -> list[str]:
    names = [n.strip() for n in given.split(",") if n.strip()]
    if not names or any(n not in SURFACES for n in names):
        raise argparse.ArgumentTypeError(f"{given!r}: a comma-separated subset of {SURFACES}")
    return list(dict.fromkeys(names))


# -- the model ----------------------------------------------------------------------------------


def resolve(arg: str | None) -> Path:
    if arg != LONG_CONTEXT:
        return model_path(arg)
    if not (LONG_CONTEXT_DIR / "config.json").exists():
        from tests.fixtures.long_context_model import build_long_context_model

        print(f"building the long-context model in {LONG_CONTEXT_DIR} ...", flush=True)
        partial = LONG_CONTEXT_DIR.with_name(LONG_CONTEXT_DIR.name + ".partial")
        build_long_context_model(partial, model_path(None))
        partial.rename(LONG_CONTEXT_DIR)
    return LONG_CONTEXT_DIR


# -- the server's send times --------------------------------------------------------------------


@dataclass
class SendTimes:
    """What one streamed response's tee saw: the server's stamp of the write holding the first
    content_block_delta, and this client's clock when that write arrived (Unix seconds)."""

    first_delta_sent: float | None = None
    first_delta_received: float | None = None
    message_start_sent: float | None = None
    message_delta_sent: float | None = None
    stamps: int = 0
    _last: float | None = None
    _tail: bytes = b""

    def feed(self, chunk: bytes) -> None:
        lines = (self._tail + chunk).split(b"\n")
        self._tail = lines.pop()
        for line in lines:
            if line.startswith(STAMP):
                self._last, self.stamps = float(line[len(STAMP) :]), self.stamps + 1
            elif line == b"event: message_start" and self.message_start_sent is None:
                self.message_start_sent = self._last
            elif line == b"event: message_delta" and self.message_delta_sent is None:
                self.message_delta_sent = self._last
            elif line == b"event: content_block_delta" and self.first_delta_sent is None:
                self.first_delta_sent, self.first_delta_received = self._last, time.time()


class _Tee(httpx2.SyncByteStream):
    def __init__(self, inner: httpx2.SyncByteStream, record: SendTimes) -> None:
        self.inner, self.record = inner, record

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.inner:
            self.record.feed(chunk)
            yield chunk

    def close(self) -> None:
        self.inner.close()


class SendTimesTransport(httpx2.HTTPTransport):
    """The SDK's transport, with a tee on /v1/messages responses into `self.record`."""

    record: SendTimes | None = None

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = super().handle_request(request)
        if self.record is not None and request.url.path.endswith("/v1/messages"):
            response.stream = _Tee(response.stream, self.record)  # type: ignore[arg-type]
        return response


# -- the session --------------------------------------------------------------------------------


@dataclass
class Turn:
    turn: int
    forced: str | None
    prompt: int
    cached: int
    recomputed: int
    new: int
    unseen: int | None
    output: int
    ttft_s: float | None
    ttft_event: str  # content_block_delta, or message_delta for an answer without any
    server_ttft_s: float | None
    message_start_s: float | None
    total_s: float
    stop_reason: str | None
    tool_calls: list[str] = field(default_factory=list)
    valid: bool | None = None  # forced turns: the call's input passes the tool's schema
    invalid_reason: str | None = None
    text: str = ""
    tool_inputs: list[dict[str, Any]] = field(default_factory=list)
    placeholder_sent_back: bool = False  # the answer was empty: PLACEHOLDER went back


def fit_prefix(args: argparse.Namespace, context: int, encode: Any) -> tuple[int, int]:
    """The prefix (system + tools) tokens to aim at, and the room the turns need: room for
    --fit-turns turns at least, so that a shorter run is the start of the same session."""
    room = MARGIN
    for turn in range(1, max(args.turns, args.fit_turns) + 1):
        room += len(encode(user_turn(turn))) + 2 * TURN_OVERHEAD
        if name := forced_tool(turn, args.forced_every):
            room += args.tool_max_tokens + len(encode(tool_result(name))) + TURN_OVERHEAD
        else:
            room += args.max_tokens
    return min(args.prefix_tokens, context - room), room


def build_system(
    client: anthropic.Anthropic, target: int, encode: Any
) -> tuple[str, dict[str, int]]:
    """A system prompt with which system + tools is about `target` tokens, as the server
    renders them (count_tokens), and the sizes measured."""

    def count(system: str) -> int:
        messages = [{"role": "user", "content": user_turn(1)}]
        return client.messages.count_tokens(
            model=SERVED_MODEL_NAME, system=system, tools=TOOLS, messages=messages
        ).input_tokens

    bare = count(".")  # the tools, the template and the first user message
    user = len(encode(user_turn(1)))
    system = system_prompt(max(target - (bare - user), 16), encode)
    first = count(system)
    sizes = {
        "system_tokens": len(encode(system)),
        "tools": len(TOOLS),
        "tools_and_template_tokens": bare - user,
        "prefix_tokens": first - user,  # what the first user message is appended to
        "turn1_prompt_tokens": first,
    }
    return system, sizes


def blocks_of(message: Any) -> list[dict[str, Any]]:
    """The assistant's content as the next request sends it back (empty text dropped)."""
    out: list[dict[str, Any]] = []
    for block in message.content:
        if block.type == "text" and block.text:
            out.append({"type": "text", "text": block.text})
        elif block.type == "tool_use":
            out.append(
                {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}
            )
    return out or [PLACEHOLDER]


def run_session(
    args: argparse.Namespace,
    client: anthropic.Anthropic,
    transport: SendTimesTransport,
    system: str,
) -> list[Turn]:
    messages: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []  # tool_result blocks for the next user message
    turns: list[Turn] = []
    for n in range(1, args.turns + 1):
        text = {"type": "text", "text": user_turn(n)}
        messages.append({"role": "user", "content": [*results, text] if results else text["text"]})
        forced = forced_tool(n, args.forced_every)
        body: dict[str, Any] = {
            "model": SERVED_MODEL_NAME,
            "system": system,
            "tools": TOOLS,
            "messages": messages,
            "max_tokens": args.tool_max_tokens if forced else args.max_tokens,
            "extra_body": {"temperature": 0},  # this SDK's stream() has no temperature
            "extra_headers": {SEND_TIMES_HEADER: "1"},
        }
        if forced:
            body["tool_choice"] = {"type": "tool", "name": forced}
        transport.record = record = SendTimes()
        sent_wall, start = time.time(), time.perf_counter()
        ttft = started = None
        ttft_event = "content_block_delta"
        with client.messages.stream(**body) as stream:
            for event in stream:
                if event.type == "message_start" and started is None:
                    started = time.perf_counter() - start
                elif event.type == "content_block_delta" and ttft is None:
                    ttft = time.perf_counter() - start
                elif event.type == "message_delta" and ttft is None:  # no delta: an empty
                    ttft, ttft_event = time.perf_counter() - start, "message_delta"  # answer
            final = stream.get_final_message()
        total = time.perf_counter() - start
        transport.record = None

        usage = final.usage
        cached = usage.cache_read_input_tokens or 0
        prompt = usage.input_tokens + cached
        prev = turns[-1] if turns else None
        new = prompt - prev.prompt if prev else prompt
        calls = [b for b in final.content if b.type == "tool_use"]
        turn = Turn(
            turn=n,
            forced=forced,
            prompt=prompt,
            cached=cached,
            recomputed=usage.input_tokens,
            new=new,
            unseen=new - prev.output if prev else None,
            output=usage.output_tokens,
            ttft_s=ttft,
            ttft_event=ttft_event,
            server_ttft_s=(
                sent - sent_wall
                if (sent := record.first_delta_sent or record.message_delta_sent)
                else None
            ),
            message_start_s=started,
            total_s=total,
            stop_reason=final.stop_reason,
            tool_calls=[b.name for b in calls],
            text="".join(b.text for b in final.content if b.type == "text"),
            tool_inputs=[{"name": b.name, "input": b.input} for b in calls],
        )
        if forced:
            turn.valid, turn.invalid_reason = validate(forced, [(b.name, b.input) for b in calls])
        turns.append(turn)
        print_turn(turn)
        content = blocks_of(final)
        turn.placeholder_sent_back = content == [PLACEHOLDER]
        messages.append({"role": "assistant", "content": content})
        results = [
            {"type": "tool_result", "tool_use_id": b.id, "content": tool_result(b.name)}
            for b in calls
        ]
    return turns


def validate(name: str, calls: list[tuple[str, Any]]) -> tuple[bool, str | None]:
    """Whether the call of `name` among the (name, input) calls passes the tool's schema."""
    call = next((c for c in calls if c[0] == name), None)
    if call is None:
        return False, f"no {name} call (got {[c[0] for c in calls]})"
    try:
        jsonschema.validate(call[1], SCHEMAS[name])
    except jsonschema.ValidationError as exc:
        return False, exc.message
    return True, None


def print_turn(t: Turn) -> None:
    ttft = f"{t.ttft_s * 1000:.0f} ms" if t.ttft_s is not None else "-"
    tool = f" forced {t.forced}: {'valid' if t.valid else t.invalid_reason}" if t.forced else ""
    print(
        f"  turn {t.turn}: prompt {t.prompt}, cached {t.cached}, recomputed {t.recomputed},"
        f" new {t.new}, out {t.output}, ttft {ttft}, total {t.total_s:.2f} s{tool}",
        flush=True,
    )


# -- the summary --------------------------------------------------------------------------------


def summary(turns: list[Turn]) -> dict[str, Any]:
    warm = turns[1:]
    text = [t for t in warm if not t.forced and t.ttft_s is not None]
    forced = [t for t in turns if t.forced]
    return {
        "turns": len(turns),
        "turn1_prompt_tokens": turns[0].prompt if turns else None,
        "turn1_ttft_ms": _ms_or_none(turns[0].ttft_s) if turns else None,
        # TTFT (first content_block_delta) on warm turns that answer in text: a forced call's
        # first delta comes after the call's opening tokens are decoded (see below).
        "ttft_fit": fit([t for t in text], "ttft_s"),
        # Time to message_start on every warm turn, forced or not (the server sends it with
        # the engine's first delta: a warm turn's prefill is one chunk, so its first token).
        "message_start_fit": fit(
            [t for t in warm if t.message_start_s is not None], "message_start_s"
        ),
        "forced_ttft_ms_median": _median([t.ttft_s * 1000 for t in forced if t.ttft_s]),
        "forced_message_start_ms_median": _median(
            [t.message_start_s * 1000 for t in forced if t.message_start_s]
        ),
        **token_ratios(warm),
        **forced_calls(forced, [t.stop_reason == "max_tokens" for t in forced]),
        "client_minus_server_ttft_ms_median": client_minus_server(turns),
    }


def token_ratios(warm: Sequence[Any]) -> dict[str, float | None]:
    """Recomputed over new and over unseen tokens, and the share read from the cache."""
    sum_new = sum(t.new for t in warm)
    sum_unseen = sum(t.unseen or 0 for t in warm)
    sum_recomputed = sum(t.recomputed for t in warm)
    return {
        "recomputed_over_new": sum_recomputed / sum_new if sum_new else None,
        "recomputed_over_unseen": sum_recomputed / sum_unseen if sum_unseen > 0 else None,
        "warm_cached_share": (
            sum(t.cached for t in warm) / sum(t.prompt for t in warm) if warm else None
        ),
    }


def forced_calls(forced: Sequence[Any], cut: list[bool]) -> dict[str, int]:
    """The forced calls, the valid ones, those cut (by the output limit) and the valid ones
    of those that ended."""
    return {
        "forced_calls": len(forced),
        "forced_calls_valid": sum(bool(t.valid) for t in forced),
        # A call cut by max_tokens streamed only part of its input (as the API does): the
        # grammar's promise is for a call that ends, so those are counted apart.
        "forced_calls_cut": sum(cut),
        "forced_calls_ended_valid": sum(
            bool(t.valid) for t, c in zip(forced, cut, strict=True) if not c
        ),
    }


def client_minus_server(turns: Sequence[Any]) -> float | None:
    return _median(
        [(t.ttft_s - t.server_ttft_s) * 1000 for t in turns if t.ttft_s and t.server_ttft_s]
    )


def fit(turns: Sequence[Any], key: str) -> dict[str, Any]:
    """Least squares of `key` (ms) against new tokens, and its correlation with new tokens
    and with the prompt's length."""
    ms = [getattr(t, key) * 1000 for t in turns]
    new = [float(t.new) for t in turns]
    prompt = [float(t.prompt) for t in turns]
    slope = intercept = None
    if len(turns) >= 2 and len(set(new)) > 1:
        slope, intercept = statistics.linear_regression(new, ms)
    return {
        "n": len(turns),
        "median_ms": _median(ms),
        "ms_per_new_token": slope,
        "intercept_ms": intercept,
        "corr_new_tokens": _corr(new, ms),
        "corr_prompt_tokens": _corr(prompt, ms),
    }


def _ms_or_none(v: float | None) -> float | None:
    return None if v is None else v * 1000


def _corr(x: list[float], y: list[float]) -> float | None:
    if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2:
        return None  # two points always lie on a line
    return statistics.correlation(x, y)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def show(turns: list[Turn], s: dict[str, Any], sizes: dict[str, int], console: Console) -> None:
    table = Table(title="agent session, per turn (times in ms)")
    heads = [
        "turn", "tool", "prompt", "cached", "recomp", "new", "unseen", "out", "ttft",
        "srv ttft", "msg start", "total", "stop", "valid",
    ]  # fmt: skip
    for h in heads:
        table.add_column(h, justify="left" if h in ("tool", "stop") else "right")
    for t in turns:
        tool = f"{t.forced}!" if t.forced else ",".join(t.tool_calls) or "-"
        table.add_row(
            str(t.turn), tool, str(t.prompt), str(t.cached), str(t.recomputed), str(t.new),
            _num(t.unseen), str(t.output),
            _ms(t.ttft_s) + ("*" if t.ttft_event == "message_delta" else ""), _ms(t.server_ttft_s),
            _ms(t.message_start_s), _ms(t.total_s), str(t.stop_reason),
            "-" if t.valid is None else ("yes" if t.valid else "NO"),
        )  # fmt: skip
    console.print(table)
    console.print(
        "  (tool: NAME! a forced call; recomp = input_tokens, the uncached part;"
        " ttft* an answer without deltas: the time to its message_delta)"
    )
    table = Table(title="summary (warm = turns 2..N)")
    table.add_column("figure")
    table.add_column("TTFT, text turns", justify="right")
    table.add_column("message_start, all", justify="right")
    ttft, start = s["ttft_fit"], s["message_start_fit"]
    for label, key in [
        ("warm turns", "n"),
        ("median ms", "median_ms"),
        ("ms per new token (least squares)", "ms_per_new_token"),
        ("intercept ms", "intercept_ms"),
        ("corr with new tokens", "corr_new_tokens"),
        ("corr with prompt tokens", "corr_prompt_tokens"),
    ]:
        table.add_row(label, _num(ttft[key]), _num(start[key]))
    console.print(table)
    rows = [
        ("prefix (system + tools) tokens", _num(sizes["prefix_tokens"])),
        ("turn 1 (cold) prompt tokens", _num(s["turn1_prompt_tokens"])),
        ("turn 1 (cold) TTFT ms", _num(s["turn1_ttft_ms"])),
        ("forced calls: TTFT ms, median", _num(s["forced_ttft_ms_median"])),
        ("forced calls: message_start ms, median", _num(s["forced_message_start_ms_median"])),
        ("recomputed / new, warm (target ~1)", _num(s["recomputed_over_new"])),
        ("recomputed / unseen, warm", _num(s["recomputed_over_unseen"])),
        ("warm prompt tokens read from cache", _pct(s["warm_cached_share"])),
        ("forced calls valid", f"{s['forced_calls_valid']}/{s['forced_calls']}"),
        (
            "forced calls that ended: valid (target 100%)",
            f"{s['forced_calls_ended_valid']}/{s['forced_calls'] - s['forced_calls_cut']}"
            f" ({s['forced_calls_cut']} cut by max_tokens)",
        ),
        ("client - server TTFT ms, median", _num(s["client_minus_server_ttft_ms_median"])),
    ]
    table = Table(show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    if isinstance(v, int) or abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


# -- the Responses API sessions ------------------------------------------------------------------


@dataclass
class Streamed:
    """What one /v1/responses stream gave: client times (seconds from sending the request),
    server send times less the client's send time (seconds), the final response object."""

    request_bytes: int
    created_s: float | None = None
    server_created_s: float | None = None
    ttft_s: float | None = None
    ttft_event: str = ""
    server_ttft_s: float | None = None
    final_gap_s: float | None = None
    total_s: float = 0.0
    response: dict[str, Any] = field(default_factory=dict)
    _write: float | None = None  # the server's stamp of the write being read
    _before: float | None = None  # and of the write before it

    def note(self, event: SseEvent, sent_wall: float) -> None:
        if event.sent != self._write:
            self._before, self._write = self._write, event.sent
        server = None if event.sent is None else event.sent - sent_wall
        if event.name == "response.created" and self.created_s is None:
            self.created_s, self.server_created_s = event.received, server
        elif event.name in FIRST_OUTPUT and self.ttft_s is None:
            self.ttft_s, self.ttft_event, self.server_ttft_s = event.received, event.name, server
        elif event.name in FINAL:
            self.response = json.loads(event.data)["response"]
            if self.ttft_s is None:  # an answer without output: to its end
                self.ttft_s, self.ttft_event, self.server_ttft_s = (
                    event.received,
                    event.name,
                    server,
                )
            if event.sent is not None and self._before is not None:
                self.final_gap_s = event.sent - self._before
        elif event.name in FAILED:
            raise RuntimeError(f"{event.name}: {event.data}")


def stream_response(http: httpx2.Client, url: str, body: dict[str, Any]) -> Streamed:
    """POST one streamed request and read its events as they arrive."""
    content = json.dumps(body).encode()
    out, reader = Streamed(len(content)), SseReader()
    headers = {"content-type": "application/json", SEND_TIMES_HEADER: "1"}
    sent_wall, start = time.time(), time.perf_counter()
    with http.stream("POST", url, content=content, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"POST {url}: {r.status_code} {r.read().decode()}")
        for chunk in r.iter_bytes():
            for event in reader.feed(chunk, time.perf_counter() - start):
                out.note(event, sent_wall)
    out.total_s = time.perf_counter() - start
    if not out.response:
        raise RuntimeError(f"POST {url}: the stream ended without {' or '.join(FINAL)}")
    return out


def get_round_trip(http: httpx2.Client, url: str, response_id: str) -> float:
    """Seconds for GET /v1/responses/{id} (the stored response, whole)."""
    start = time.perf_counter()
    r = http.get(f"{url}/{response_id}")
    elapsed = time.perf_counter() - start
    if r.status_code != 200 or r.json().get("id") != response_id:
        raise RuntimeError(f"GET {url}/{response_id}: {r.status_code} {r.text[:200]}")
    return elapsed


@dataclass
class ResponsesTurn:
    turn: int
    forced: str | None
    prompt: int  # usage.input_tokens
    cached: int  # usage.input_tokens_details.cached_tokens
    recomputed: int  # prompt less cached
    new: int
    unseen: int | None
    output: int
    ttft_s: float | None
    ttft_event: str  # response.output_item.added / .output_text.delta, or the final event
    server_ttft_s: float | None
    created_s: float | None  # to response.created
    server_created_s: float | None
    final_gap_s: float | None  # server: the final event's write less the write before it
    total_s: float
    status: str
    incomplete_reason: str | None
    response_id: str
    request_items: int  # the request's input items
    request_bytes: int
    get_s: float | None = None  # chain: a GET /v1/responses/{id} round trip after the turn
    tool_calls: list[str] = field(default_factory=list)
    valid: bool | None = None
    invalid_reason: str | None = None
    text: str = ""
    tool_inputs: list[dict[str, Any]] = field(default_factory=list)
    placeholder_sent_back: bool = False


def responses_body(
    args: argparse.Namespace, system: str, forced: str | None, store: bool
) -> dict[str, Any]:
    """A turn's request, its input aside (instructions and tools go on every request)."""
    body: dict[str, Any] = {
        "model": SERVED_MODEL_NAME,
        "instructions": system,
        "tools": RESPONSES_TOOLS,
        "stream": True,
        "store": store,
        "temperature": 0,
        "max_output_tokens": args.tool_max_tokens if forced else args.max_tokens,
    }
    if forced:
        body["tool_choice"] = {"type": "function", "name": forced}
    return body


def run_responses(
    args: argparse.Namespace, http: httpx2.Client, base_url: str, system: str, mode: str
) -> list[ResponsesTurn]:
    """The session through /v1/responses: `replay` sends every item so far with store: false,
    `chain` the items since the last response with previous_response_id and store: true."""
    url, chain = base_url + RESPONSES_PATH, mode == "chain"
    history: list[dict[str, Any]] = []  # the items before `pending`: what replay sends again
    pending: list[dict[str, Any]] = []  # the items since the last response
    turns: list[ResponsesTurn] = []
    for n in range(1, args.turns + 1):
        pending.append({"type": "message", "role": "user", "content": user_turn(n)})
        forced = forced_tool(n, args.forced_every)
        body = responses_body(args, system, forced, chain)
        body["input"] = pending if chain else [*history, *pending]
        if chain and turns:
            body["previous_response_id"] = turns[-1].response_id
        streamed = stream_response(http, url, body)
        turn = responses_turn(n, forced, streamed, turns[-1] if turns else None)
        turn.request_items = len(body["input"])
        if chain:
            turn.get_s = get_round_trip(http, url, turn.response_id)
        turns.append(turn)
        print_responses_turn(mode, turn)
        output = streamed.response["output"]
        back = items_back(output)
        turn.placeholder_sent_back = not back
        history += [*pending, *(back or [PLACEHOLDER_ITEM])]
        pending = [PLACEHOLDER_ITEM] if chain and not back else []
        pending += [
            {
                "type": "function_call_output",
                "call_id": i["call_id"],
                "output": tool_result(i["name"]),
            }
            for i in output
            if i["type"] == "function_call"
        ]
    return turns


def items_back(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output's messages and calls as the next request gives them back (as Codex does
    with store: false); empty when the answer was empty."""
    back: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message" and (text := _text([item])):
            part = {"type": "output_text", "text": text}
            back.append({"type": "message", "role": "assistant", "content": [part]})
        elif item["type"] == "function_call":
            keys = ("call_id", "name", "arguments")
            back.append({"type": "function_call", **{k: item[k] for k in keys}})
    return back


def responses_turn(
    n: int, forced: str | None, s: Streamed, prev: ResponsesTurn | None
) -> ResponsesTurn:
    r, usage = s.response, s.response["usage"]
    prompt, cached = usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]
    new = prompt - prev.prompt if prev else prompt
    calls = [i for i in r["output"] if i["type"] == "function_call"]
    inputs = [(c["name"], _arguments(c["arguments"])) for c in calls]
    turn = ResponsesTurn(
        turn=n,
        forced=forced,
        prompt=prompt,
        cached=cached,
        recomputed=prompt - cached,
        new=new,
        unseen=new - prev.output if prev else None,
        output=usage["output_tokens"],
        ttft_s=s.ttft_s,
        ttft_event=s.ttft_event,
        server_ttft_s=s.server_ttft_s,
        created_s=s.created_s,
        server_created_s=s.server_created_s,
        final_gap_s=s.final_gap_s,
        total_s=s.total_s,
        status=r["status"],
        incomplete_reason=(r.get("incomplete_details") or {}).get("reason"),
        response_id=r["id"],
        request_items=0,
        request_bytes=s.request_bytes,
        tool_calls=[c["name"] for c in calls],
        text=_text(r["output"]),
        tool_inputs=[{"name": name, "input": given} for name, given in inputs],
    )
    if forced:
        turn.valid, turn.invalid_reason = validate(forced, inputs)
    return turn


def _text(output: list[dict[str, Any]]) -> str:
    return "".join(
        part.get("text", "")
        for item in output
        if item["type"] == "message"
        for part in item.get("content", [])
        if part.get("type") == "output_text"
    )


def _arguments(raw: str) -> Any:
    """A call's arguments, parsed; the string itself when it is not JSON (then invalid)."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def print_responses_turn(mode: str, t: ResponsesTurn) -> None:
    get = f", get {t.get_s * 1000:.1f} ms" if t.get_s is not None else ""
    tool = f" forced {t.forced}: {'valid' if t.valid else t.invalid_reason}" if t.forced else ""
    print(
        f"  {mode} turn {t.turn}: prompt {t.prompt}, cached {t.cached}, recomputed"
        f" {t.recomputed}, new {t.new}, out {t.output}, ttft {_ms(t.ttft_s)} ms, created"
        f" {_ms(t.created_s)} ms, total {t.total_s:.2f} s{get}{tool}",
        flush=True,
    )


def responses_summary(turns: list[ResponsesTurn]) -> dict[str, Any]:
    warm = turns[1:]
    text = [t for t in warm if not t.forced and t.ttft_s is not None]
    forced = [t for t in turns if t.forced]
    return {
        "turns": len(turns),
        "turn1_prompt_tokens": turns[0].prompt if turns else None,
        "turn1_ttft_ms": _ms_or_none(turns[0].ttft_s) if turns else None,
        "ttft_fit": fit(text, "ttft_s"),
        "created_fit": fit([t for t in warm if t.created_s is not None], "created_s"),
        "forced_ttft_ms_median": _median([t.ttft_s * 1000 for t in forced if t.ttft_s]),
        **token_ratios(warm),
        **forced_calls(forced, [t.status == "incomplete" for t in forced]),
        "client_minus_server_ttft_ms_median": client_minus_server(turns),
        "warm_medians_ms": {key: _warm_median(warm, key) for key in MEDIANS},
        "request_bytes_last": turns[-1].request_bytes if turns else None,
        "request_bytes_sum": sum(t.request_bytes for t in turns),
    }


# The warm medians compared across the modes (ms): the key, the turn's field.
MEDIANS = {
    "created": "created_s",
    "server_created": "server_created_s",
    "final_gap": "final_gap_s",
    "total": "total_s",
    "get_round_trip": "get_s",
}


def _warm_median(warm: list[ResponsesTurn], key: str) -> float | None:
    return _median([v * 1000 for t in warm if (v := getattr(t, MEDIANS[key])) is not None])


def chain_minus_replay(replay: dict[str, Any], chain: dict[str, Any]) -> dict[str, float | None]:
    """Chain's warm medians less replay's: what store: true (and sending only the new items)
    adds to a response; the GET round trip is chain's own."""
    a, b = replay["warm_medians_ms"], chain["warm_medians_ms"]
    out = {k: None if a[k] is None or b[k] is None else b[k] - a[k] for k in MEDIANS}
    out["get_round_trip"] = b["get_round_trip"]
    return out


def show_responses(
    sessions: dict[str, list[ResponsesTurn]], summaries: dict[str, Any], console: Console
) -> None:
    for mode, turns in sessions.items():
        console.print(responses_table(mode, turns))
    console.print(
        "  (ttft: to the first output item or text delta, * an answer without output: to its"
        " end; final gap: the server's final write less the one before it, the last engine"
        " step and, in chain, the store's write; get: GET /v1/responses/{id})"
    )
    console.print(comparison_table(summaries))


def responses_table(mode: str, turns: list[ResponsesTurn]) -> Table:
    table = Table(title=f"Responses API, {mode}, per turn (times in ms)")
    heads = [
        "turn", "tool", "prompt", "cached", "recomp", "new", "out", "ttft", "srv ttft",
        "created", "final gap", "total", "get", "items", "KiB", "status", "valid",
    ]  # fmt: skip
    for h in heads:
        table.add_column(h, justify="left" if h in ("tool", "status") else "right")
    for t in turns:
        tool = f"{t.forced}!" if t.forced else ",".join(t.tool_calls) or "-"
        table.add_row(
            str(t.turn), tool, str(t.prompt), str(t.cached), str(t.recomputed), str(t.new),
            str(t.output), _ms(t.ttft_s) + ("*" if t.ttft_event in FINAL else ""),
            _ms(t.server_ttft_s), _ms(t.created_s), _ms1(t.final_gap_s), _ms(t.total_s),
            _ms1(t.get_s), str(t.request_items), f"{t.request_bytes / 1024:.0f}",
            t.status,
            "-" if t.valid is None else ("yes" if t.valid else "NO"),
        )  # fmt: skip
    return table


def comparison_table(summaries: dict[str, Any]) -> Table:
    table = Table(title="Responses API summary (warm = turns 2..N)")
    table.add_column("figure")
    for mode in summaries:
        table.add_column(mode, justify="right")
    both = all(m in summaries for m in MODES)
    if both:
        table.add_column("chain - replay", justify="right")
    diff = chain_minus_replay(summaries["replay"], summaries["chain"]) if both else {}
    for label, value in comparison_rows():
        cells = [value(s) for s in summaries.values()]
        table.add_row(label, *cells, *([""] if both else []))
    for key, label in MEDIAN_LABELS.items():
        cells = [_num(s["warm_medians_ms"][key]) for s in summaries.values()]
        extra = [_num(diff[key]) if key != "get_round_trip" else ""] if both else []
        table.add_row(label, *cells, *extra)
    return table


MEDIAN_LABELS = {
    "created": "response.created ms, warm median",
    "server_created": "server: response.created ms, warm median",
    "final_gap": "final write gap ms, warm median",
    "total": "total ms, warm median",
    "get_round_trip": "GET /v1/responses/{id} ms, median",
}


def comparison_rows() -> list[tuple[str, Any]]:
    ttft = lambda key: lambda s: _num(s["ttft_fit"][key])  # noqa: E731
    return [
        ("turn 1 (cold) prompt tokens", lambda s: _num(s["turn1_prompt_tokens"])),
        ("turn 1 (cold) TTFT ms", lambda s: _num(s["turn1_ttft_ms"])),
        ("TTFT ms, warm text turns, median", ttft("median_ms")),
        ("TTFT ms per new token", ttft("ms_per_new_token")),
        ("TTFT corr new / prompt tokens", lambda s: _corrs(s["ttft_fit"])),
        ("forced calls: TTFT ms, median", lambda s: _num(s["forced_ttft_ms_median"])),
        ("recomputed / new, warm", lambda s: _num(s["recomputed_over_new"])),
        ("recomputed / unseen, warm", lambda s: _num(s["recomputed_over_unseen"])),
        ("warm prompt tokens read from cache", lambda s: _pct(s["warm_cached_share"])),
        ("forced calls valid (of those that ended)", _forced_cell),
        ("request KiB, last turn", lambda s: f"{(s['request_bytes_last'] or 0) / 1024:.0f}"),
    ]


def _corrs(f: dict[str, Any]) -> str:
    return f"{_num(f['corr_new_tokens'])} / {_num(f['corr_prompt_tokens'])}"


def _forced_cell(s: dict[str, Any]) -> str:
    ended = s["forced_calls"] - s["forced_calls_cut"]
    return (
        f"{s['forced_calls_valid']}/{s['forced_calls']} ({s['forced_calls_ended_valid']}/{ended})"
    )


def _ms1(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


# -- the run ------------------------------------------------------------------------------------


def environment(args: argparse.Namespace, model: Path, context: int) -> dict[str, Any]:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "cpu_count": cpu_count(),
        "os_cpu_count": os.cpu_count(),
        "load_average_start": os.getloadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            n: version(n) for n in ("zerohop", "anthropic", "httpx2", "jsonschema", "torch")
        },
        "git_commit": commit or None,
        "model": str(model),
        "model_arg": args.model,
        "model_context": context,
        "flags": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }


@dataclass
class Sessions:
    """What the sessions gave: the prompt, each surface's turns and its server."""

    system: str | None = None
    sizes: dict[str, int] = field(default_factory=dict)
    anthropic: list[Turn] | None = None
    responses: dict[str, list[ResponsesTurn]] = field(default_factory=dict)
    servers: dict[str, dict[str, Any]] = field(default_factory=dict)  # surface: cmd, log


def server_for(args: argparse.Namespace, model: Path, surface: str, state: Path) -> ZerohopServer:
    """A fresh server for one surface's session (so that its turn 1 starts cold); the
    Responses sessions' with a fresh key store (their stored responses) in `state`."""
    flags = [
        "--num-threads", str(args.threads), "--max-num-batched-tokens",
        str(args.max_num_batched_tokens), *shlex.split(args.zerohop_args),
    ]  # fmt: skip
    name = "agents-server.log"
    if surface != "anthropic":
        flags += ["--keys-db", str(state / f"{surface}-keys.db")]
        name = f"agents-server-{surface}.log"
    return ZerohopServer(model, flags, args.out.parent / name, served_name=SERVED_MODEL_NAME)


def anthropic_client(url: str, transport: SendTimesTransport) -> anthropic.Anthropic:
    http = httpx2.Client(transport=transport, timeout=600.0)
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, http_client=http)


def run_surfaces(
    args: argparse.Namespace, model: Path, prefix: tuple[int, int], encode: Any, console: Console
) -> Sessions:
    """Each surface's session on a server of its own; the prompt built on the first.
    `prefix`: the prefix's target tokens and the model's context."""
    target, context = prefix
    out = Sessions()
    transport = SendTimesTransport()
    with tempfile.TemporaryDirectory(prefix="zerohop-agents-") as state:
        for surface in args.surfaces:
            with server_for(args, model, surface, Path(state)) as server:
                client = anthropic_client(server.url, transport)
                if out.system is None:  # count_tokens on the first server
                    out.system, out.sizes = build_system(client, target, encode)
                    print_prefix(out.sizes, context, console)
                console.print(f"{surface} session:")
                if surface == "anthropic":
                    out.anthropic = run_session(args, client, transport, out.system)
                else:
                    with httpx2.Client(timeout=600.0) as http:
                        turns = run_responses(args, http, server.url, out.system, surface)
                    out.responses[surface] = turns
            out.servers[surface] = {"server_cmd": server.cmd, "server_log": str(server.log)}
    return out


def print_prefix(sizes: dict[str, int], context: int, console: Console) -> None:
    console.print(
        f"prefix: {sizes['prefix_tokens']} tokens (system {sizes['system_tokens']},"
        f" {sizes['tools']} tools + template {sizes['tools_and_template_tokens']});"
        f" context {context}"
    )


def responses_report(sessions: Sessions) -> dict[str, Any]:
    """The JSON's "responses": per mode its server, summary and turns; chain less replay."""
    out: dict[str, Any] = {}
    for mode, turns in sessions.responses.items():
        out[mode] = sessions.servers[mode] | {
            "summary": responses_summary(turns),
            "turns": [asdict(t) for t in turns],
        }
    if all(m in out for m in MODES):
        out["chain_minus_replay_ms"] = chain_minus_replay(
            out["replay"]["summary"], out["chain"]["summary"]
        )
    return out


def main() -> dict[str, Any]:
    args = parse_args()
    console = Console(width=max(Console().width, 150))  # the Responses tables
    model = resolve(args.model)
    config, tokenizer = open_model(model)
    context = config.max_position_embeddings
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    target, room = fit_prefix(args, context, encode)
    if target < args.prefix_tokens:
        console.print(
            f"[yellow]{model.name}: {context} positions;"
            f" {max(args.turns, args.fit_turns)} turns need ~{room},"
            f" so the prefix is {target} tokens, not {args.prefix_tokens}[/yellow]"
        )
    if os.getloadavg()[0] > 0.5 * cpu_count():
        console.print(
            f"[yellow]load average {os.getloadavg()[0]:.2f} on {cpu_count()} CPUs: the"
            " timings are a smoke run, not figures to quote[/yellow]"
        )
    report: dict[str, Any] = {"environment": environment(args, model, context)}
    sessions = run_surfaces(args, model, (target, context), encode, console)
    report["environment"]["load_average_end"] = os.getloadavg()
    report |= sessions.servers.get("anthropic", {})
    report["prompt"] = sessions.sizes | {"prefix_target": target, "room_for_turns": room}
    if sessions.anthropic is not None:
        report["summary"] = s = summary(sessions.anthropic)
        report["turns"] = [asdict(t) for t in sessions.anthropic]
        show(sessions.anthropic, s, sessions.sizes, console)
    if sessions.responses:
        report["responses"] = responses = responses_report(sessions)
        summaries = {m: responses[m]["summary"] for m in sessions.responses}
        show_responses(sessions.responses, summaries, console)
    write_json(args.out, report)
    console.print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
