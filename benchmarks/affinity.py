"""zerohop.client's prefix affinity against round robin, side by side in one run.

Workload: --conversations (8) chats run at once (--concurrency, default all of them), each
with a long system prompt of its own (--system-words, ~1,500 tokens of the default model's by
default: numbered help-desk rules, generated from a per-conversation seed, so every prompt
differs from its first KV block on), each doing --turns (4) user turns in sequence; every turn
appends the previous answer and a new user message, as a chat does. Answers are --max-tokens
(8) tokens, temperature 0, streamed. The client is the official `anthropic` SDK
(AsyncAnthropic, Messages API) over `zerohop.client.async_http_client` and a ReplicaPool.

The same workload runs three ways, each on freshly started replicas (the prefix cache starts
cold every time):
  affinity     --replicas (3) replicas, `AffinityPolicy()` (rendezvous hashing of each
               conversation's opening, bounded by load);
  affinity_unbounded  the same, with the load bound off (prefix affinity alone);
  round_robin  the same replicas, `RoundRobinPolicy()`: each request to the next replica;
  single       one replica: the reference hit rate (every turn finds its own prefix).
Each replica is `zerohop serve MODEL --no-gateway --num-threads --threads (1) --max-queue-wait
0` (harness.zerohop_server, an XDG_DATA_HOME of its own), warmed by one user-only request.
--max-queue-wait 0 turns overload refusal off: 8 cold ~1,500-token prompts queue past the
default 30 s on a slow CPU, and a refused request fails over to a replica without its prefix,
which would measure load shedding, not placement.

Per request: TTFT (until the first content_block_delta), end-to-end time, and the usage.
Per mode: prefix-cache hit rate = sum(cache_read_input_tokens) / sum(input_tokens +
cache_read_input_tokens), over all turns and over turns >= 2 (a first turn cannot hit);
TTFT mean / p50 / p90 (all turns, turns >= 2); requests per replica and the affinity ratio
(requests placed by affinity / requests) from `pool.stats()`; the CPU the whole machine used
(of --threads x replicas engine threads on `cpus` cores: a shared 2-core machine is
oversubscribed by 3 replicas, the same way for affinity and round robin).

    .venv/bin/python benchmarks/affinity.py            # the default model (SmolLM2-135M)
    .venv/bin/python benchmarks/affinity.py --tiny     # tests/fixtures' tiny Llama: a smoke run
    .venv/bin/python benchmarks/affinity.py --model PATH [--system-words 600] [--turns 4]

Prints two tables and writes bench-results/affinity.json (--out); server logs go to
bench-results/affinity-MODE-N.log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anthropic
from _common import ROOT, cpu_count, model_path, print_table, write_json
from _procstat import machine_busy_s
from harness.zerohop_server import ZerohopServer

import zerohop.client as zc
from zerohop.bench.metrics import distribution_ms

SERVED_MODEL_NAME = "affinity-bench"
MODES = ("affinity", "affinity_unbounded", "round_robin", "single")
DEFAULT_SYSTEM_WORDS = 1250  # ~1,500 tokens of SmolLM2's tokenizer
# The tiny model's 2,048 positions and byte-level tokenizer (~1.6 characters a token): 400
# words is ~2,100 characters, so that, as with the default model, the system prompt is longer
# than AffinityPolicy's key (its first 2,048 characters).
TINY_SYSTEM_WORDS = 400
WORKLOAD_KEYS = (
    "conversations", "concurrency", "turns", "system_words", "max_tokens", "seed", "replicas",
    "threads", "max_queue_wait", "zerohop_args",
)  # fmt: skip

Policy = zc.AffinityPolicy | zc.RoundRobinPolicy


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", default=None, help="a path, `standard` or `tiny`")
    model.add_argument("--tiny", action="store_true", help="a tiny random Llama: a smoke run")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, run in this order")
    p.add_argument("--replicas", type=int, default=3, help="replicas of the affinity/RR modes")
    p.add_argument("--threads", type=int, default=1, help="engine threads of each replica")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=None, help="default: all conversations")
    p.add_argument("--turns", type=int, default=4, help="user turns per conversation")
    p.add_argument("--system-words", type=int, default=None, help=f"{DEFAULT_SYSTEM_WORDS}")
    p.add_argument("--max-tokens", type=int, default=8, help="answer length of every turn")
    p.add_argument("--seed", type=int, default=0, help="of the prompts (the same in all modes)")
    p.add_argument("--max-queue-wait", type=float, default=0.0, help="0: never refuse")
    p.add_argument("--zerohop-args", default="", help="appended to every `zerohop serve`")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "affinity.json")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := set(args.modes) - set(MODES):
        p.error(f"unknown --modes {sorted(unknown)}; of {MODES}")
    if args.system_words is None:
        args.system_words = TINY_SYSTEM_WORDS if args.tiny else DEFAULT_SYSTEM_WORDS
    args.concurrency = args.concurrency or args.conversations
    return args


# -- prompts --------------------------------------------------------------------------------------

CONDITIONS = (
    "When a visitor asks about", "If a fisherman mentions", "Whenever someone complains about",
    "Should a student ask about", "When the weather turns and people ask about",
    "If a buyer from the restaurants wants to know about", "When a child asks about",
    "If a caller is angry about", "When the ferry is late and someone asks about",
)  # fmt: skip
TOPICS = (
    "the tide tables", "the ferry times", "the fish market", "net repairs", "the lighthouse "
    "museum", "winter storms", "the ice plant", "harbour fees", "the road to the island", "the "
    "rock pools", "the bakery's hours", "boat engines", "visitor parking", "the old cinema",
    "crab season", "the breakwater", "the morning train", "the seal caves", "the quay cranes",
)  # fmt: skip
ACTIONS = ("answer", "explain", "summarize", "describe", "compare the options", "list the facts")
STYLES = (
    "in one short sentence", "with a concrete example", "politely but firmly", "without jargon",
    "as a numbered list", "citing the local timetable", "in plain words", "for a child of ten",
    "and mention the weather", "and offer to call back later", "in a calm and friendly tone",
)  # fmt: skip
REASONS = (
    "because the tide decides when the boats can leave",
    "since most visitors arrive on the morning train with maps and no idea of the tides",
    "as the storms can keep the boats in port for a week at a time",
    "because the buyers need the catch sorted and packed before the sun clears the cliffs",
    "since the streets are too steep for cars and the gardens are walled against the wind",
    "as nobody on the quay says much before the first bus climbs the hill",
    "because the museum by the lighthouse stays open late in summer",
    "since the road to the island is only dry twice a day",
)
QUESTIONS = (
    "What time does the first ferry leave tomorrow?", "Can I park near the harbour tonight?",
    "Is the fish market open on Sundays?", "How do I get to the island when the tide is out?",
    "Who repairs nets around here, and how much do they charge?",
    "Why were the boats kept in port last week?", "Where can I buy fresh crab this morning?",
    "Is the lighthouse museum suitable for children?", "What is showing at the old cinema?",
    "When does the bakery open in summer?", "Are there guided trips to the seal caves?",
    "What should I do if a storm warning is issued?",
)  # fmt: skip


def system_prompt(seed: int, words: int) -> str:
    """A help desk's rules, `words` words long; `seed` makes its very first words its own."""
    rng = random.Random(seed)
    # The number first: with the chat template's few tokens, it falls in the first KV block.
    head = f"Desk {rng.randrange(10**6):06d}: you are the help desk of harbour town {seed}."
    out = f"{head} Follow these rules in every answer.".split()
    rule = 1
    while len(out) < words:
        out += (
            f"Rule {rule}: {rng.choice(CONDITIONS)} {rng.choice(TOPICS)}, "
            f"{rng.choice(ACTIONS)} {rng.choice(STYLES)}, {rng.choice(REASONS)}."
        ).split()
        rule += 1
    return " ".join(out[:words])


def user_message(seed: int, turn: int) -> str:
    rng = random.Random(f"{seed}-{turn}")
    return f"{rng.choice(QUESTIONS)} (message {turn})"


@dataclass(slots=True, frozen=True)
class Conversation:
    index: int
    system: str
    questions: tuple[str, ...]


def conversations(args: argparse.Namespace) -> list[Conversation]:
    """The workload: the same conversations (prompts) in every mode."""
    out = []
    for i in range(args.conversations):
        seed = 1000 * args.seed + i
        questions = tuple(user_message(seed, t) for t in range(1, args.turns + 1))
        out.append(Conversation(i, system_prompt(seed, args.system_words), questions))
    return out


# -- one mode -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Turn:
    """One request's figures."""

    conversation: int
    turn: int  # 1-based
    ttft_s: float | None = None
    e2e_s: float | None = None
    input_tokens: int = 0
    cache_read_input_tokens: int = 0
    output_tokens: int = 0
    answer: str = ""
    error: str | None = None


async def run_conversation(
    client: anthropic.AsyncAnthropic, conv: Conversation, max_tokens: int
) -> list[Turn]:
    """Its turns one after the other; a failed turn ends the conversation."""
    messages: list[dict[str, str]] = []
    turns = []
    for number, question in enumerate(conv.questions, start=1):
        messages.append({"role": "user", "content": question})
        turn = Turn(conv.index, number)
        turns.append(turn)
        try:
            await stream_turn(client, conv.system, messages, max_tokens, turn)
        except anthropic.APIError as exc:
            turn.error = f"{type(exc).__name__}: {exc}"
            break
        # The answer as it came (as a chat sends it back), but never empty: the API refuses that.
        answer = turn.answer if turn.answer.strip() else "(no answer)"
        messages.append({"role": "assistant", "content": answer})
    return turns


async def stream_turn(
    client: anthropic.AsyncAnthropic,
    system: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    turn: Turn,
) -> None:
    start = time.perf_counter()
    async with client.messages.stream(
        model=SERVED_MODEL_NAME,
        system=system,
        messages=messages,
        max_tokens=max_tokens,
        extra_body={"temperature": 0},  # not a parameter of this SDK version's `stream`
    ) as stream:
        async for event in stream:
            if event.type == "content_block_delta" and turn.ttft_s is None:
                turn.ttft_s = time.perf_counter() - start
        message = await stream.get_final_message()
    turn.e2e_s = time.perf_counter() - start
    usage = message.usage
    turn.input_tokens = usage.input_tokens
    turn.cache_read_input_tokens = usage.cache_read_input_tokens or 0
    turn.output_tokens = usage.output_tokens
    turn.answer = "".join(b.text for b in message.content if b.type == "text")


async def run_workload(
    pool: zc.ReplicaPool, convs: Sequence[Conversation], args: argparse.Namespace
) -> list[Turn]:
    """All conversations, `args.concurrency` at a time, through the SDK over `pool`."""
    client = anthropic.AsyncAnthropic(
        base_url="http://zerohop",  # a name only: the pool chooses the replica
        api_key="x",
        max_retries=0,
        http_client=zc.async_http_client(pool=pool),
    )
    gate = asyncio.Semaphore(args.concurrency)

    async def one(conv: Conversation) -> list[Turn]:
        async with gate:
            return await run_conversation(client, conv, args.max_tokens)

    try:
        results = await asyncio.gather(*(one(c) for c in convs))
    finally:
        await client.close()
    return [turn for turns in results for turn in turns]


async def warm_up(urls: Sequence[str]) -> None:
    """One short request to each replica directly (a user-only prompt: no system block)."""
    for url in urls:
        async with anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0) as client:
            await client.messages.create(
                model=SERVED_MODEL_NAME,
                messages=[{"role": "user", "content": "Warm-up: say hello."}],
                max_tokens=2,
            )


@contextlib.contextmanager
def replicas(args: argparse.Namespace, model: Path, mode: str, n: int) -> Iterator[list[str]]:
    """`n` fresh `zerohop serve` replicas (cold prefix caches), stopped on exit."""
    with contextlib.ExitStack() as stack:
        urls = []
        for i in range(n):
            data = stack.enter_context(tempfile.TemporaryDirectory(prefix="zerohop-affinity-"))
            # Its own XDG_DATA_HOME: the audit log and key store lock their folder.
            log = args.out.parent / f"{args.out.stem}-{mode}-{i}.log"
            server = ZerohopServer(
                model, serve_args(args), log, served_name=SERVED_MODEL_NAME, XDG_DATA_HOME=data
            )
            urls.append(stack.enter_context(server).url)
        yield urls


def serve_args(args: argparse.Namespace) -> list[str]:
    flags = ["--no-gateway", "--num-threads", str(args.threads)]
    return [*flags, "--max-queue-wait", str(args.max_queue_wait), *shlex.split(args.zerohop_args)]


def policy_for(mode: str) -> Policy:
    if mode == "round_robin":
        return zc.RoundRobinPolicy()
    if mode == "affinity_unbounded":  # prefix affinity alone: load never moves a request
        return zc.AffinityPolicy(wait_slack_ms=math.inf, in_flight_slack=sys.maxsize)
    return zc.AffinityPolicy()


def run_mode(
    args: argparse.Namespace, model: Path, mode: str, convs: Sequence[Conversation]
) -> dict:
    n = 1 if mode == "single" else args.replicas
    print(f"\n== {mode}: {n} replica(s)", flush=True)
    with replicas(args, model, mode, n) as urls:
        asyncio.run(warm_up(urls))
        pool = zc.ReplicaPool(urls, affinity=policy_for(mode))
        try:
            busy0, start = machine_busy_s(), time.perf_counter()
            turns = asyncio.run(run_workload(pool, convs, args))
            wall = time.perf_counter() - start
            busy = (machine_busy_s() - busy0) / wall
            stats = pool.stats()
        finally:
            pool.close()
    result = summarize(mode, urls, turns, stats) | {"wall_s": wall, "machine_busy_cores": busy}
    print(
        f"  {wall:.1f}s, hit rate {fmt_pct(result['hit_rate'])} (turns >= 2: "
        f"{fmt_pct(result['hit_rate_turns_2plus'])}), requests per replica "
        f"{result['requests_per_replica']}, failed {result['failed']}",
        flush=True,
    )
    return result


# -- figures --------------------------------------------------------------------------------------


def hit_rate(turns: Sequence[Turn]) -> float | None:
    read = sum(t.cache_read_input_tokens for t in turns)
    total = read + sum(t.input_tokens for t in turns)
    return read / total if total else None


def summarize(
    mode: str, urls: Sequence[str], turns: Sequence[Turn], stats: dict[str, dict[str, Any]]
) -> dict:
    ok = [t for t in turns if t.error is None]
    later = [t for t in ok if t.turn >= 2]
    per_replica = [stats.get(url, {}) for url in urls]
    requests = sum(s.get("requests", 0) for s in per_replica)
    by_affinity = sum(s.get("by_affinity", 0) for s in per_replica)
    first = [t.input_tokens + t.cache_read_input_tokens for t in ok if t.turn == 1]
    return {
        "mode": mode,
        "replicas": list(urls),
        "requests": len(turns),
        "failed": len(turns) - len(ok),
        "errors": sorted({t.error for t in turns if t.error}),
        "hit_rate": hit_rate(ok),
        "hit_rate_turns_2plus": hit_rate(later),
        "first_turn_prompt_tokens_mean": sum(first) / len(first) if first else None,
        "ttft_ms": distribution_ms([t.ttft_s for t in ok if t.ttft_s is not None]),
        "ttft_ms_turns_2plus": distribution_ms([t.ttft_s for t in later if t.ttft_s is not None]),
        "e2e_ms": distribution_ms([t.e2e_s for t in ok if t.e2e_s is not None]),
        "e2e_ms_turns_2plus": distribution_ms([t.e2e_s for t in later if t.e2e_s is not None]),
        "requests_per_replica": [s.get("requests", 0) for s in per_replica],
        "affinity_ratio": by_affinity / requests if requests else None,
        "failovers": sum(s.get("failovers", 0) for s in per_replica),
        "pool_stats": stats,
        "turns": [asdict(t) for t in turns],
    }


def fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def stat(dist: dict | None, key: str) -> float | None:
    return None if dist is None else dist[key]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(results: dict[str, dict]) -> dict:
    """Affinity and round robin against the single replica's hit rate, and against each
    other on TTFT of turns >= 2."""
    single = results.get("single", {})
    out: dict[str, float | None] = {}
    for mode in ("affinity", "affinity_unbounded", "round_robin"):
        if mode in results:
            rate = results[mode]["hit_rate_turns_2plus"]
            out[f"{mode}_hit_rate_2plus_over_single"] = ratio(
                rate, single.get("hit_rate_turns_2plus")
            )
    if "affinity" in results and "round_robin" in results:
        for key in ("mean", "p50", "p90"):
            out[f"affinity_over_round_robin_ttft_2plus_{key}"] = ratio(
                stat(results["affinity"]["ttft_ms_turns_2plus"], key),
                stat(results["round_robin"]["ttft_ms_turns_2plus"], key),
            )
    return out


def print_report(results: dict[str, dict], comparison: dict, args: argparse.Namespace) -> None:
    print(
        f"\n== {args.conversations} conversations x {args.turns} turns, {args.concurrency} at "
        f"once, {args.system_words}-word system prompts, {args.max_tokens} output tokens"
    )
    rows: list[list[object]] = []
    for mode, r in results.items():
        rows.append([
            mode, len(r["replicas"]), r["first_turn_prompt_tokens_mean"],
            "/".join(map(str, r["requests_per_replica"])), r["affinity_ratio"], r["failovers"],
            r["failed"], fmt_pct(r["hit_rate"]), fmt_pct(r["hit_rate_turns_2plus"]),
            r["wall_s"], r["machine_busy_cores"],
        ])  # fmt: skip
    print_table(
        [
            "mode", "replicas", "turn-1 prompt tok", "requests/replica", "affinity ratio",
            "failovers", "failed", "hit rate", "hit rate t>=2", "wall s", "busy cores",
        ],
        rows,
    )  # fmt: skip
    print()
    timing = []
    for mode, r in results.items():
        all_, later = r["ttft_ms"], r["ttft_ms_turns_2plus"]
        timing.append([
            mode, stat(all_, "mean"), stat(all_, "p50"), stat(all_, "p90"),
            stat(later, "mean"), stat(later, "p50"), stat(later, "p90"),
            stat(r["e2e_ms"], "p50"), stat(r["e2e_ms_turns_2plus"], "p50"),
        ])  # fmt: skip
    print_table(
        [
            "mode", "TTFT mean ms", "TTFT p50", "TTFT p90", "TTFT t>=2 mean", "t>=2 p50",
            "t>=2 p90", "E2E p50 ms", "E2E t>=2 p50",
        ],
        timing,
    )  # fmt: skip
    for key, value in comparison.items():
        print(f"  {key}: {'-' if value is None else f'{value:.3f}'}")
    print(
        f"busy cores: CPU the whole machine used during the workload, of {cpu_count()} "
        "(other jobs included)"
    )


# -- main -----------------------------------------------------------------------------------------


def tiny_model(folder: Path) -> Path:
    from tests.fixtures.tiny_models import build_tiny_model

    return build_tiny_model(folder / "tiny-llama", "llama")


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the running servers too
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zerohop-affinity-model-") as tmp:
        model = tiny_model(Path(tmp)) if args.tiny else model_path(args.model)
        print(f"model: {model}", flush=True)
        convs = conversations(args)
        results = {mode: run_mode(args, model, mode, convs) for mode in args.modes}
    comparison = compare(results)
    wall = time.perf_counter() - start
    report = {
        "model": "tiny (tests/fixtures/tiny_models.py, llama)" if args.tiny else str(model),
        "cpus": cpu_count(),
        "loadavg_at_end": os.getloadavg(),
        "wall_s": wall,
        "workload": {k: getattr(args, k) for k in WORKLOAD_KEYS},
        "hit_rate": "sum(cache_read_input_tokens) / sum(input_tokens + cache_read_input_tokens)",
        "modes": results,
        "compare": comparison,
    }
    write_json(args.out, report)
    print_report(results, comparison, args)
    print(f"\nwrote {args.out} ({wall:.0f}s in all)")
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
