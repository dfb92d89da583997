"""Part 2 of benchmarks/fleet.py: how much of a tenant's budget the fleet serves before every
stream is refused, settled + leased sampled against the budget, 3 SQLite replicas as contrast."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import psycopg
from _fleet_base import (
    MODEL,
    RETRY_CAP,
    RETRY_SLEEP,
    SAMPLE_EVERY,
    SPEND_DEADLINE,
    SPEND_MAX_TOKENS,
    USABLE_TARGET,
    Fleet,
    brief_timeline,
    fmt,
)

from tests.live_server import LiveServer
from zerohop.client import ReplicaPool, async_http_client
from zerohop.gateway.store.sqlite import KeyStore

# -- 2: usable budget -------------------------------------------------------------------------


def budget_state(url: str, subject: str) -> tuple[int, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT settled, leased FROM budget_state WHERE subject = %s", (subject,)
        ).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


class Sampler:
    """settled and leased of one subject every SAMPLE_EVERY seconds, from a thread."""

    def __init__(self, url: str, subject: str, budget: int) -> None:
        self.url, self.subject, self.budget = url, subject, budget
        self.samples = 0
        self.max_charged = 0  # settled + leased
        self.violations = 0  # samples with settled + leased > budget
        self.errors = 0
        self.leases: list[tuple[float, int, int, list[int]]] = []  # on change: see _held
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="budget-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _held(self, conn: psycopg.Connection, settled: int, leased: int) -> None:
        """(s, settled, leased, what each active lease holds unreported), when it changes."""
        rows = conn.execute(
            "SELECT granted - settled FROM leases WHERE subject = %s AND state = 'active'"
            " ORDER BY replica_id",
            (self.subject,),
        ).fetchall()
        held = [int(r[0]) for r in rows]
        if not self.leases or self.leases[-1][1:] != (settled, leased, held):
            self.leases.append((time.monotonic() - self._started, settled, leased, held))

    def _run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._stop.wait(SAMPLE_EVERY):
                try:
                    row = conn.execute(
                        "SELECT settled, leased FROM budget_state WHERE subject = %s",
                        (self.subject,),
                    ).fetchone()
                except psycopg.Error:
                    self.errors += 1
                    continue
                charged = 0 if row is None else int(row[0]) + int(row[1])
                if row is not None:
                    self._held(conn, int(row[0]), int(row[1]))
                self.samples += 1
                self.max_charged = max(self.max_charged, charged)
                self.violations += charged > self.budget


@dataclass(slots=True)
class Tally:
    started: float = field(default_factory=time.monotonic)
    tokens: int = 0
    answers: int = 0
    exhausted: int = 0
    retried: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    first_refusal_s: float | None = None
    refusal_message: str | None = None
    last_refusal_s: float | None = None
    first_refusal_state: tuple[int, int] | None = None
    events: list[tuple[float, str, int]] = field(default_factory=list)  # (s, kind, tokens)

    def note(self, kind: str, tokens: int = 0) -> None:
        self.events.append((time.monotonic() - self.started, kind, tokens))


def is_budget_refusal(exc: anthropic.APIStatusError) -> bool:
    return exc.status_code == 429 and "budget" in str(exc.message)


def retry_wait(exc: anthropic.APIStatusError, fixed: float | None) -> float:
    """What the official SDKs wait: retry-after-ms, else retry-after (capped)."""
    if fixed is not None:
        return fixed
    headers = exc.response.headers
    with contextlib.suppress(TypeError, ValueError):
        if (ms := headers.get("retry-after-ms")) is not None:
            return min(RETRY_CAP, float(ms) / 1000)
        if (seconds := headers.get("retry-after")) is not None:
            return min(RETRY_CAP, float(seconds))
    return RETRY_SLEEP


def retry_reason(exc: anthropic.APIStatusError) -> str:
    text = str(exc.message)
    if "share of the token budget" in text:
        return f"{exc.status_code} budget_lease_unavailable"
    return f"{exc.status_code} other"


async def spend_worker(
    client: anthropic.AsyncAnthropic,
    n: int,
    tally: Tally,
    on_refused: Callable[[], Any],
    deadline: float,
    retry_sleep: float | None,
) -> None:
    """Requests until this worker is refused as over budget (or the deadline passes)."""
    while time.monotonic() < deadline:
        try:
            message = await client.messages.create(
                model=MODEL,
                max_tokens=SPEND_MAX_TOKENS,
                extra_body={"temperature": 0},
                messages=[{"role": "user", "content": f"count to {n}"}],
            )
        except anthropic.APIStatusError as exc:
            if is_budget_refusal(exc):
                tally.exhausted += 1
                tally.refusal_message = tally.refusal_message or str(exc.message)
                tally.note("refused")
                await on_refused()
                return
            if exc.status_code in (503, 529):
                tally.retried[retry_reason(exc)] += 1
                tally.note("retried")
                await asyncio.sleep(retry_wait(exc, retry_sleep))
                continue
            tally.errors[f"{exc.status_code} {exc.message}"[:120]] += 1
            await asyncio.sleep(RETRY_SLEEP)
            continue
        except anthropic.APIConnectionError as exc:
            tally.errors[type(exc).__name__] += 1
            await asyncio.sleep(RETRY_SLEEP)
            continue
        tokens = message.usage.input_tokens + message.usage.output_tokens
        tally.answers += 1
        tally.tokens += tokens
        tally.note("answer", tokens)


async def spend_budget(
    urls: list[str], key: str, args: argparse.Namespace, url: str | None
) -> tuple[Tally, dict]:
    """`streams` workers over `urls` through zerohop.client until each is refused."""
    pool = ReplicaPool(urls)
    client = anthropic.AsyncAnthropic(
        base_url="http://zerohop",  # a name only: the pool chooses the replica
        api_key=key,
        max_retries=0,
        http_client=async_http_client(pool=pool),
    )
    tally = Tally()

    async def on_refused() -> None:
        now = time.monotonic() - tally.started
        tally.last_refusal_s = now
        if tally.first_refusal_s is None:
            tally.first_refusal_s = now
            if url is not None:
                tally.first_refusal_state = await asyncio.to_thread(
                    budget_state, url, "tenant:usable"
                )

    deadline = time.monotonic() + SPEND_DEADLINE
    workers = (
        spend_worker(client, n, tally, on_refused, deadline, args.retry_sleep)
        for n in range(args.streams)
    )
    try:
        await asyncio.gather(*workers)
    finally:
        await client.close()
        stats = pool.stats()
        pool.close()
    return tally, stats


def timeline(tally: Tally, step: float) -> list[dict]:
    """Per `step` seconds: answers, their tokens, 529/503 retries, budget refusals."""
    bins: dict[int, Counter] = {}
    for at, kind, tokens in tally.events:
        counts = bins.setdefault(int(at // step), Counter())
        counts[kind] += 1
        counts["tokens"] += tokens
    last = max(bins, default=-1)
    return [{"from_s": i * step, **bins.get(i, Counter())} for i in range(last + 1)]


def gaps(tally: Tally) -> list[tuple[float, float]]:
    """(seconds, from s) of each time without an answer, until the last refusal."""
    end = tally.last_refusal_s or 0.0
    answers = [at for at, kind, _ in tally.events if kind == "answer"]
    marks = [0.0, *answers, end]
    return [(b - a, a) for a, b in itertools.pairwise(marks)]


def tally_figures(tally: Tally, budget: int, stats: dict, streams: int) -> dict:
    spans = gaps(tally)
    stall, stall_from = max(spans, default=(0.0, 0.0))
    return {
        "budget": budget,
        "streams": streams,
        "tokens_served": tally.tokens,
        "served_over_budget": tally.tokens / budget,
        "answers": tally.answers,
        "refused_insufficient_quota": tally.exhausted,
        "every_stream_refused": tally.exhausted == streams,
        "retried": dict(tally.retried),
        "errors": dict(tally.errors),
        "first_refusal_s": tally.first_refusal_s,
        "refusal_message": tally.refusal_message,
        "last_refusal_s": tally.last_refusal_s,
        "requests_per_replica": {u: s.get("requests", 0) for u, s in stats.items()},
        "failovers": sum(s.get("failovers", 0) for s in stats.values()),
        "longest_stall_s": stall,
        "longest_stall_from_s": stall_from,
        "stalls_over_5s": [{"seconds": g, "from_s": at} for g, at in spans if g > 5.0],
        "timeline_10s": timeline(tally, 10.0),
    }


STORE_SERIES = (
    "zerohop_store_latency_seconds_count",
    "zerohop_store_latency_seconds_sum",
    'zerohop_budget_lease_renewals_total{result="full"}',
    'zerohop_budget_lease_renewals_total{result="partial"}',
    'zerohop_budget_lease_renewals_total{result="none"}',
)


def store_counters(servers: Sequence[LiveServer]) -> dict[str, float]:
    """The fleet's lease-keeper counters, summed over `servers` (GET /metrics)."""
    totals = dict.fromkeys(STORE_SERIES, 0.0)
    for server in servers:
        for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
            name, _, value = line.rpartition(" ")
            if name in totals:
                totals[name] += float(value)
    return totals


def store_work(before: dict[str, float], after: dict[str, float], requests: int) -> dict:
    delta = {name: after[name] - before[name] for name in STORE_SERIES}
    count = delta["zerohop_store_latency_seconds_count"]
    return {
        "http_requests": requests,
        "transactions": int(count),
        "transactions_per_http_request": count / requests if requests else None,
        "lease_top_ups": int(sum(v for k, v in delta.items() if "renewals" in k)),
        "mean_transaction_ms": 1000 * delta["zerohop_store_latency_seconds_sum"] / count
        if count
        else None,
    }


def usable_fleet(f: Fleet, args: argparse.Namespace) -> dict:
    budget = args.budget
    counters = store_counters(f.fleet)
    with Sampler(f.url, "tenant:usable", budget) as sampler:
        tally, stats = asyncio.run(
            spend_budget([s.url for s in f.fleet], f.keys["usable"], args, f.url)
        )
        at_end = budget_state(f.url, "tenant:usable")
        time.sleep(6.0)  # every replica reports its spend within 5 s
    later = budget_state(f.url, "tenant:usable")
    out = tally_figures(tally, budget, stats, args.streams)
    requests = sum(out["requests_per_replica"].values())
    first = tally.first_refusal_state or (0, 0)
    out |= {
        "store_work": store_work(counters, store_counters(f.fleet), requests),
        "settled_at_first_refusal": first[0],
        "leased_at_first_refusal": first[1],
        "settled_at_first_refusal_over_budget": first[0] / budget,
        "charged_at_first_refusal_over_budget": sum(first) / budget,
        "settled_leased_at_end": at_end,
        "settled_leased_6s_later": later,
        "settled_6s_later_over_budget": later[0] / budget,
        "samples": sampler.samples,
        "max_settled_plus_leased": sampler.max_charged,
        "max_settled_plus_leased_over_budget": sampler.max_charged / budget,
        "samples_over_budget": sampler.violations,
        "sample_errors": sampler.errors,
        "lease_changes": [
            {"at_s": at, "settled": st, "leased": le, "held_per_lease": held}
            for at, st, le, held in sampler.leases
        ],
        "target_served_over_budget": USABLE_TARGET,
    }
    return out


def solo_spend(folder: Path) -> int:
    """Tokens the solo replica's own ledger charged the usable tenant."""
    store = KeyStore(folder / "data" / "zerohop" / "keys.db")
    try:
        return sum(t for s, _, t in store.spend() if s == "tenant:usable")
    finally:
        store.close()


def usable_solo(f: Fleet, args: argparse.Namespace) -> dict:
    budget = args.contrast_budget
    urls = [s.url for s in f.solo]
    tally, stats = asyncio.run(spend_budget(urls, f.keys["solo_usable"], args, None))
    spends = [solo_spend(f.folders[f"solo{i}"]) for i in range(3)]
    return tally_figures(tally, budget, stats, args.streams) | {
        "ledger_spend_per_replica": spends,
        "ledger_spend_over_budget": sum(spends) / budget,
    }


def print_usable(fleet: dict, solo: dict) -> None:
    print(
        f"\n== 2. usable budget, {fleet['streams']} streams through zerohop.client over 3 replicas"
    )
    print(
        f"  fleet (PostgreSQL, B {fleet['budget']}): served {fleet['tokens_served']} tokens ="
        f" {100 * fleet['served_over_budget']:.1f}% of B (target >= 95%);"
        f" settled at the first refusal {100 * fleet['settled_at_first_refusal_over_budget']:.1f}%"
        f" (settled + leased {100 * fleet['charged_at_first_refusal_over_budget']:.1f}%),"
        f" settled 6 s after the last {100 * fleet['settled_6s_later_over_budget']:.1f}%"
    )
    print(
        f"  settled + leased <= B: max {fleet['max_settled_plus_leased']}"
        f" ({100 * fleet['max_settled_plus_leased_over_budget']:.1f}% of B) over"
        f" {fleet['samples']} samples, {fleet['samples_over_budget']} over B;"
        f" {fleet['answers']} answers, refused {fleet['refused_insufficient_quota']}/"
        f"{fleet['streams']}, retried {fleet['retried']}, first refusal at"
        f" {fmt(fleet['first_refusal_s'], '.1f')} s, last {fmt(fleet['last_refusal_s'], '.1f')} s"
    )
    work = fleet["store_work"]
    print(
        f"  the fleet's lease keepers: {work['transactions']} PostgreSQL transactions for"
        f" {work['http_requests']} HTTP requests"
        f" ({fmt(work['transactions_per_http_request'], '.2f')} per request; a request waits"
        " for one only when its lease cannot cover it: once the budget runs scarce, every"
        f" time), {work['lease_top_ups']} top-ups, mean"
        f" {fmt(work['mean_transaction_ms'], '.2f')} ms"
    )
    stalls = ", ".join(
        f"{g['seconds']:.1f} s from {g['from_s']:.1f} s" for g in fleet["stalls_over_5s"]
    )
    print(
        f"  times without an answer over 5 s: fleet {stalls or 'none'}; longest for the SQLite"
        f" replicas {solo['longest_stall_s']:.1f} s; per 10 s (answers / retries): fleet"
        f" {brief_timeline(fleet)}"
    )
    print(
        f"  contrast, 3 replicas each on its own SQLite store with B {solo['budget']}: served"
        f" {solo['tokens_served']} tokens = {solo['served_over_budget']:.2f}x B (ledgers:"
        f" {solo['ledger_spend_per_replica']}, {solo['ledger_spend_over_budget']:.2f}x B);"
        f" refused {solo['refused_insufficient_quota']}/{solo['streams']}"
    )
