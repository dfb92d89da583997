"""What every part of benchmarks/fleet.py shares: its constants, the figures' helpers, and
the six replicas (three on one PostgreSQL store, three on SQLite copies) with their keys."""

from __future__ import annotations

import argparse
import contextlib
import sqlite3
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import ROOT

from tests.live_server import LiveServer
from tests.pg_fixtures import fresh_database
from tests.postgres_server import PostgresServer
from zerohop.gateway.keys.identity import Budget, Limits, Tenant
from zerohop.gateway.store.pg_migrations import migrate
from zerohop.gateway.store.postgres import PostgresStore
from zerohop.gateway.store.spec import STORE_ENV
from zerohop.gateway.store.sqlite import KeyStore

MODEL = "fleet-bench"
OUT = ROOT / "bench-results" / "fleet.json"
ADDED_TARGET_MS = 0.1  # pg_lease - none, p50 per request
USABLE_TARGET = 0.95  # tokens served / budget
WINDOWS = (1.0, 10.0, 60.0)  # seconds, of the rate overshoot
RETRY_SLEEP = 0.2  # seconds before a 529/503 without retry-after is retried
RETRY_CAP = 5.0  # seconds: the most a retry-after is waited
SAMPLE_EVERY = 0.1  # seconds between budget_state samples
SPEND_MAX_TOKENS = 16
SPEND_DEADLINE = 600.0  # seconds: a safety net only (every stream should be refused)
BIG_BUDGET = 10**12  # never refuses (part 1)
TTFT_BUDGET = 10**9


# -- figures ----------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def brief_timeline(r: dict) -> str:
    return " ".join(f"{b.get('answer', 0)}/{b.get('retried', 0)}" for b in r["timeline_10s"])


# -- the replicas -----------------------------------------------------------------------------


@dataclass(slots=True)
class Fleet:
    url: str  # the shared store's database
    fleet: list[LiveServer]
    solo: list[LiveServer]
    keys: dict[str, str]  # purpose -> secret in PostgreSQL; "solo_" + purpose: in the copies
    folders: dict[str, Path]


def fleet_keys(url: str, args: argparse.Namespace) -> dict[str, str]:
    store = PostgresStore(url)
    try:
        return make_keys(store, args.budget, args.rpm)
    finally:
        store.close()


def make_keys(store: Any, budget: int, rpm: int) -> dict[str, str]:
    """The tenants the served parts use, and a key of each (no limits of its own)."""
    store.upsert_tenant(Tenant("usable", budget=Budget(budget)))
    store.upsert_tenant(Tenant("ttft", budget=Budget(TTFT_BUDGET)))
    store.upsert_tenant(Tenant("rated", limits=Limits(rpm=rpm)))
    store.upsert_tenant(Tenant("free"))  # no budget, no limits
    return {name: store.create_key(name)[0] for name in ("usable", "ttft", "rated", "free")}


def solo_store(path: Path, args: argparse.Namespace) -> dict[str, str]:
    """The SQLite store the solo replicas get a copy each of (B = the contrast budget)."""
    store = KeyStore(path)
    try:
        return make_keys(store, args.contrast_budget, args.rpm)
    finally:
        store.close()


def copy_store(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    source, target = sqlite3.connect(src), sqlite3.connect(dst)
    try:
        source.backup(target)
    finally:
        source.close()
        target.close()


def start_replica(stack: contextlib.ExitStack, folder: Path, env: dict[str, str]) -> LiveServer:
    server = LiveServer(None, [], served_model_name=MODEL, extra_env=env)
    stack.callback(server.stop)  # before start: an interrupted start is stopped too
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    server.start(folder / "server.log", timeout=300)
    print(f"  {folder.name}: {server.url} ready in {time.monotonic() - started:.1f}s", flush=True)
    return server


def start_all(
    stack: contextlib.ExitStack, pg: PostgresServer, work: Path, args: argparse.Namespace
) -> Fleet:
    url = fresh_database(pg)
    migrate(url)
    keys = fleet_keys(url, args)
    template = work / "solo-template.db"
    solo_keys = solo_store(template, args)
    folders: dict[str, Path] = {}
    fleet, solo = [], []
    print("starting 6 replicas, one after another", flush=True)
    for i in range(3):
        folders[f"fleet{i}"] = work / f"fleet{i}"
        fleet.append(start_replica(stack, folders[f"fleet{i}"], {STORE_ENV: url}))
    for i in range(3):
        folder = folders[f"solo{i}"] = work / f"solo{i}"
        copy_store(template, folder / "data" / "zerohop" / "keys.db")
        solo.append(start_replica(stack, folder, {}))
    keys |= {f"solo_{name}": secret for name, secret in solo_keys.items()}
    return Fleet(url, fleet, solo, keys, folders)
