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

Prints the per-turn table and the summary (rich) and writes bench-results/agents.json (--out):
every turn, the summary, the prompt's sizes and the environment (CPUs, load averages, model,
flags, versions, server command); the server's log is bench-results/agents-server.log.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import shlex
import subprocess
import time
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
from _agent_stats import summary
from _common import ROOT, cpu_count, model_path, open_model, write_json
from _send_times import SEND_TIMES_HEADER, SendTimes, SendTimesTransport
from harness.zerohop_server import ZerohopServer
from rich.console import Console
from rich.table import Table

SERVED_MODEL_NAME = "agents-bench"
LONG_CONTEXT = "long-context"
LONG_CONTEXT_DIR = Path.home() / ".cache" / "zerohop" / "bench-models" / "long-context-64k"
# Per message, the chat template's own tokens (role markers, separators) and a margin for a
# re-tokenized answer: the room kept for each turn when sizing the prefix.
TURN_OVERHEAD = 24
MARGIN = 64
# An empty answer goes back as this text: the API takes no empty text block or content.
PLACEHOLDER = {"type": "text", "text": "(no answer)"}


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
    p.add_argument("--zerohop-args", default="", help="more `zerohop serve` flags (one string)")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "agents.json")
    return p.parse_args()


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


def server_for(args: argparse.Namespace, model: Path) -> ZerohopServer:
    """A fresh server for the session, so that its turn 1 starts cold."""
    flags = [
        "--num-threads", str(args.threads), "--max-num-batched-tokens",
        str(args.max_num_batched_tokens), *shlex.split(args.zerohop_args),
    ]  # fmt: skip
    log = args.out.parent / "agents-server.log"
    return ZerohopServer(model, flags, log, served_name=SERVED_MODEL_NAME)


def anthropic_client(url: str, transport: SendTimesTransport) -> anthropic.Anthropic:
    http = httpx2.Client(transport=transport, timeout=600.0)
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, http_client=http)


def print_prefix(sizes: dict[str, int], context: int, console: Console) -> None:
    console.print(
        f"prefix: {sizes['prefix_tokens']} tokens (system {sizes['system_tokens']},"
        f" {sizes['tools']} tools + template {sizes['tools_and_template_tokens']});"
        f" context {context}"
    )


def main() -> dict[str, Any]:
    args = parse_args()
    console = Console(width=max(Console().width, 150))
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
    transport = SendTimesTransport()
    with server_for(args, model) as server:
        client = anthropic_client(server.url, transport)
        system, sizes = build_system(client, target, encode)  # count_tokens on the server
        print_prefix(sizes, context, console)
        turns = run_session(args, client, transport, system)
    report["environment"]["load_average_end"] = os.getloadavg()
    report |= {"server_cmd": server.cmd, "server_log": str(server.log)}
    report["prompt"] = sizes | {"prefix_target": target, "room_for_turns": room}
    report["summary"] = s = summary(turns)
    report["turns"] = [asdict(t) for t in turns]
    show(turns, s, sizes, console)
    write_json(args.out, report)
    console.print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
