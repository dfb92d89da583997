"""Part 3 of benchmarks/fleet.py: the worst overshoot of a fleet-wide rate limit while the
traffic moves between replicas, from the replicas' audit records."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path

import httpx
import psycopg
from _common import print_table
from _fleet_base import MODEL, WINDOWS, Fleet

# -- 3: rate overshoot ------------------------------------------------------------------------


def phase_plan(args: argparse.Namespace) -> list[list[int]]:
    """Which fleet replicas each phase sends to: fleet0, fleet1, then all three."""
    return [[0], [1], [0, 1, 2]] * args.cycles


async def rated_request(
    http: httpx.AsyncClient, url: str, key: str, n: int, log: list[tuple[float, int]]
) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 1,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"ping {n}"}],
    }
    sent = time.time()
    try:
        response = await http.post(url + "/v1/messages", json=body, headers={"x-api-key": key})
        log.append((sent, response.status_code))
    except httpx.HTTPError:
        log.append((sent, -1))


async def offer_load(
    f: Fleet, args: argparse.Namespace
) -> tuple[float, dict[str, list[tuple[float, int]]]]:
    """3 L per minute, evenly spaced, to the fleet (by phase) and to solo0, at once."""
    interval = 60.0 / (3 * args.rpm)
    plan = phase_plan(args)
    logs: dict[str, list[tuple[float, int]]] = {"fleet": [], "single": []}
    tasks = []
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        start, start_wall = time.monotonic(), time.time()
        n = 0
        for phase, targets in enumerate(plan):
            end = (phase + 1) * args.phase_seconds
            while (at := n * interval) < end:
                await asyncio.sleep(max(0.0, start + at - time.monotonic()))
                replica = f.fleet[targets[n % len(targets)]]
                sends = (
                    (replica.url, f.keys["rated"], logs["fleet"]),
                    (f.solo[0].url, f.keys["solo_rated"], logs["single"]),
                )
                for url, key, log in sends:
                    tasks.append(asyncio.ensure_future(rated_request(http, url, key, n, log)))
                n += 1
        await asyncio.gather(*tasks)
    return start_wall, logs


def audit_records(folder: Path) -> Iterator[dict]:
    """Every record of a replica's audit log (rotated files first, as they chain)."""
    import orjson

    audit = folder / "data" / "zerohop" / "audit"
    for path in sorted(audit.glob("audit*.jsonl"), key=lambda p: (p.name == "audit.jsonl", p)):
        for line in path.read_bytes().splitlines():
            with contextlib.suppress(orjson.JSONDecodeError):  # a torn tail
                yield orjson.loads(line)


def record_time(record: dict) -> float:
    return datetime.fromisoformat(record["time"]).timestamp()


def audit_admissions(folder: Path, tenant: str) -> list[float]:
    """Arrival times (unix s) of the tenant's admitted requests in a replica's audit log."""
    return [
        record_time(r)
        for r in audit_records(folder)
        if r.get("tenant") == tenant and r.get("decision") in ("admitted", "clamped")
    ]


def worst_window(times: Sequence[float], window: float) -> int:
    """The most admissions in any closed interval `window` seconds long."""
    ordered = sorted(times)
    best, j = 0, 0
    for i, t in enumerate(ordered):
        while ordered[j] < t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


def overshoot(times: Sequence[float], rpm: int) -> dict[str, dict]:
    out = {}
    for window in WINDOWS:
        bound = rpm + rpm * window / 60.0
        worst = worst_window(times, window)
        out[f"{window:g}"] = {
            "bound": bound,
            "worst_admitted": worst,
            "overshoot_over_L": (worst - bound) / rpm,
        }
    return out


class SharePoller:
    """The fleet's rate shares of one subject (PostgreSQL's rate_shares) every 0.5 s from a
    thread, kept each time they change: (s, {replica: share})."""

    def __init__(self, url: str, subject: str, names: dict[str, str]) -> None:
        self.url, self.subject, self.names = url, subject, names  # pid -> replica name
        self.changes: list[tuple[float, dict[str, float]]] = []
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="share-poller", daemon=True)

    def __enter__(self) -> SharePoller:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _name(self, replica_id: str) -> str:
        parts = replica_id.rsplit("-", 2)  # host-pid-hex (lease_keeper.new_replica_id)
        return self.names.get(parts[1], replica_id) if len(parts) == 3 else replica_id

    def _run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._stop.wait(0.5):
                with contextlib.suppress(psycopg.Error):
                    rows = conn.execute(
                        "SELECT replica_id, share FROM rate_shares WHERE subject = %s"
                        " AND expires_at > now()",
                        (self.subject,),
                    ).fetchall()
                    shares = {self._name(r): round(float(v), 3) for r, v in sorted(rows)}
                    if not self.changes or self.changes[-1][1] != shares:
                        self.changes.append((time.monotonic() - self.started, shares))


def per_phase(times: Sequence[float], start: float, args: argparse.Namespace) -> list[int]:
    counts = [0] * len(phase_plan(args))
    for t in times:
        phase = int((t - start) // args.phase_seconds)
        if 0 <= phase < len(counts):
            counts[phase] += 1
    return counts


def rate_overshoot(f: Fleet, args: argparse.Namespace) -> dict:
    started = time.time() - 1.0  # audit records of this part only (other tenants aside)
    names = {str(server.process.pid): f"fleet{i}" for i, server in enumerate(f.fleet)}
    with SharePoller(f.url, "tenant:rated", names) as shares:
        load_start, logs = asyncio.run(offer_load(f, args))
    time.sleep(1.0)  # the audit logs' last flush (every 0.2 s)
    per_replica = [
        [t for t in audit_admissions(f.folders[f"fleet{i}"], "rated") if t >= started]
        for i in range(3)
    ]
    fleet_times = [t for times in per_replica for t in times]
    single_times = [t for t in audit_admissions(f.folders["solo0"], "rated") if t >= started]
    client = {name: [t for t, status in log if status == 200] for name, log in logs.items()}
    statuses = {name: dict(Counter(s for _, s in log)) for name, log in logs.items()}
    return {
        "L_rpm": args.rpm,
        "offered_per_minute": 3 * args.rpm,
        "phases": [[f"fleet{i}" for i in p] for p in phase_plan(args)],
        "phase_seconds": args.phase_seconds,
        "duration_s": len(phase_plan(args)) * args.phase_seconds,
        "statuses": statuses,
        "admitted": {"fleet": len(fleet_times), "single": len(single_times)},
        "fleet_admitted_per_replica": [len(times) for times in per_replica],
        "admitted_per_phase": {
            "fleet": per_phase(fleet_times, load_start, args),
            "single": per_phase(single_times, load_start, args),
            "fleet_per_replica": [per_phase(t, load_start, args) for t in per_replica],
        },
        "audit": {
            "fleet": overshoot(fleet_times, args.rpm),
            "single": overshoot(single_times, args.rpm),
        },
        "client_200s": {name: overshoot(times, args.rpm) for name, times in client.items()},
        "share_changes": [{"at_s": at, "shares": v} for at, v in shares.changes],
        "shares_by_second": shares_by_second(shares.changes, len(phase_plan(args)), args),
    }


def shares_by_second(
    changes: list[tuple[float, dict[str, float]]], phases: int, args: argparse.Namespace
) -> dict[str, list[float]]:
    """Each fleet replica's share at every 5th second of the run (0 where it holds none)."""
    out: dict[str, list[float]] = {f"fleet{i}": [] for i in range(3)}
    for second in range(0, int(phases * args.phase_seconds) + 1, 5):
        current: dict[str, float] = {}
        for at, shares in changes:
            if at <= second:
                current = shares
        for name, values in out.items():
            values.append(current.get(name, 0.0))
    return out


def print_rates(r: dict) -> None:
    print(
        f"\n== 3. rate overshoot: L = {r['L_rpm']} rpm, offered {r['offered_per_minute']}/min"
        f" for {r['duration_s']:.0f} s, phases of {r['phase_seconds']:g} s: {r['phases'][:3]}"
    )
    rows = []
    for window in (f"{w:g}" for w in WINDOWS):
        fleet, single = r["audit"]["fleet"][window], r["audit"]["single"][window]
        rows.append([
            window, fleet["bound"], fleet["worst_admitted"], fleet["overshoot_over_L"],
            single["worst_admitted"], single["overshoot_over_L"],
            r["client_200s"]["fleet"][window]["worst_admitted"],
        ])  # fmt: skip
    headers = [
        "T s", "L + L*T/60", "fleet A(T)", "fleet overshoot/L", "single A(T)",
        "single overshoot/L", "fleet A(T) client 200s",
    ]  # fmt: skip
    print_table(headers, rows)
    worst = max(v["overshoot_over_L"] for v in r["audit"]["fleet"].values())
    print(
        f"  admitted: fleet {r['admitted']['fleet']} (per replica"
        f" {r['fleet_admitted_per_replica']}), single {r['admitted']['single']}; worst fleet"
        f" overshoot {worst:+.3f} L ({'inside' if worst <= 0 else 'past'} the bound)"
    )
    for name, values in r["shares_by_second"].items():
        print(f"  {name}'s share every 5 s: {' '.join(f'{v:.2f}' for v in values)}")
    phases = r["admitted_per_phase"]
    print(
        f"  admitted per {r['phase_seconds']:g} s phase (offered"
        f" {r['offered_per_minute'] * r['phase_seconds'] / 60:.0f} each, the limit refills"
        f" {r['L_rpm'] * r['phase_seconds'] / 60:.0f}): fleet {phases['fleet']}, single"
        f" {phases['single']}"
    )
