"""Budget lease transactions (gateway/store/lease_tables.py) on a real PostgreSQL: grants stay
within the budget whatever replicas and sweeps interleave, reports and returns are exact,
and an expired lease is charged, not freed."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from tests.pg_fixtures import migrated_database
from tests.postgres_server import PostgresServer
from zerohop.gateway.store import lease_tables as leases
from zerohop.gateway.store.lease_tables import LeaseChange

SUBJECT, PERIOD = "tenant:acme", "total"


@pytest.fixture
def url(postgres: PostgresServer) -> str:
    return migrated_database(postgres)


def _state(conn: psycopg.Connection) -> tuple[int, int, int]:
    """(settled, leased, Σ granted − settled of active leases), read in one snapshot."""
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        row = conn.execute(
            "SELECT settled, leased FROM budget_state WHERE subject = %s AND period = %s",
            (SUBJECT, PERIOD),
        ).fetchone()
        (active,) = conn.execute(
            "SELECT coalesce(sum(granted - settled), 0) FROM leases WHERE state = 'active'"
        ).fetchone()
    settled, leased = row or (0, 0)
    return settled, leased, active


def test_grants_share_what_is_free_and_never_more(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        first = leases.change(
            conn, "r1", LeaseChange(SUBJECT, PERIOD, 1000, None, want=800, share=0.5), 60
        )
        assert (first.added, first.granted, first.free) == (500, 500, 500)
        second = leases.change(conn, "r2", LeaseChange(SUBJECT, PERIOD, 1000, None, want=800), 60)
        assert (second.added, second.free, second.held_elsewhere) == (500, 0, 500)
        third = leases.change(conn, "r3", LeaseChange(SUBJECT, PERIOD, 1000, None, want=10), 60)
        assert third.lease_id is None and third.added == 0
        assert _state(conn) == (0, 1000, 1000)


def test_report_give_back_and_close_are_exact_and_idempotent(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        lease = leases.change(conn, "r1", LeaseChange(SUBJECT, PERIOD, 1000, None, want=600), 60)
        lid = lease.lease_id
        report = LeaseChange(SUBJECT, PERIOD, 1000, lid, spent=250, give_back=100)
        after = leases.change(conn, "r1", report, 60)
        assert (after.granted, after.free) == (500, 500) and _state(conn) == (250, 250, 250)
        again = leases.change(conn, "r1", LeaseChange(SUBJECT, PERIOD, 1000, lid, spent=250), 60)
        assert again.granted == 500 and _state(conn) == (250, 250, 250)  # a retry: no change
        closed = leases.change(
            conn, "r1", LeaseChange(SUBJECT, PERIOD, 1000, lid, spent=400, close=True), 60
        )
        assert closed.lease_id is None and _state(conn) == (400, 0, 0)
        (state,) = conn.execute("SELECT state FROM leases WHERE lease_id = %s", (lid,)).fetchone()
        assert state == "returned"


def test_a_lowered_budget_grants_nothing_more(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        lid = leases.change(
            conn, "r1", LeaseChange(SUBJECT, PERIOD, 1000, None, want=900), 60
        ).lease_id
        lowered = leases.change(
            conn, "r1", LeaseChange(SUBJECT, PERIOD, 500, lid, spent=100, want=50), 60
        )
        assert lowered.added == 0 and lowered.free == 500 - 900


def test_expired_lease_is_charged_and_its_replica_told(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        lid = leases.change(
            conn, "dead", LeaseChange(SUBJECT, PERIOD, 1000, None, want=300), 0.2
        ).lease_id
        leases.change(conn, "dead", LeaseChange(SUBJECT, PERIOD, 1000, lid, spent=120), 0.2)
        live = leases.change(conn, "live", LeaseChange(SUBJECT, PERIOD, 1000, None, want=100), 60)
        time.sleep(0.3)
        beat = leases.heartbeat(conn, "live", 60, "host", "test")
        assert beat.renewed == {live.lease_id: (120, 280)} and beat.replicas == 1
        assert leases.sweep(conn) == [(SUBJECT, PERIOD, 180)]
        assert _state(conn) == (300, 100, 100)
        assert leases.sweep(conn) == []
        lost = leases.change(
            conn, "dead", LeaseChange(SUBJECT, PERIOD, 1000, lid, spent=200, want=50), 60
        )
        assert lost.lost and _state(conn) == (300, 100, 100)


def test_invariant_holds_under_concurrent_replicas_and_sweeps(url: str) -> None:
    limit, failures = 5000, []

    def replica(name: str, seed: int) -> None:
        rnd = random.Random(seed)
        lease_id, granted, spent = None, 0, 0
        with psycopg.connect(url, autocommit=True) as conn:
            for _ in range(120):
                op = rnd.random()
                if lease_id is not None and op < 0.5:
                    spent = min(granted, spent + rnd.randint(0, 200))
                give_back = rnd.randint(0, granted - spent) if op > 0.8 else 0
                ttl = 0.05 if op > 0.97 else 30  # now and then, let it expire
                c = LeaseChange(
                    SUBJECT, PERIOD, limit, lease_id, spent=spent, give_back=give_back,
                    want=rnd.randint(0, 900), share=rnd.choice((0.5, 1.0)), close=op > 0.95,
                )  # fmt: skip
                try:
                    reply = leases.change(conn, name, c, ttl)
                except psycopg.errors.SerializationFailure as exc:  # none expected
                    failures.append(exc)
                    return
                if reply.lost or reply.lease_id is None:
                    lease_id, granted, spent = None, 0, 0
                else:
                    lease_id, granted = reply.lease_id, reply.granted
                    if spent > granted:  # a thread's assert could not fail the test
                        failures.append((name, "spent", spent, "granted", granted))

    def sweeper(stop: threading.Event) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            while not stop.is_set():
                leases.sweep(conn)
                settled, leased, active = _state(conn)
                if settled + leased > limit or leased != active:
                    failures.append((settled, leased, active))

    def recorded(run: Callable[..., None]) -> Callable[..., None]:
        """`run`, whose exception (an error in a thread would be lost) becomes a failure."""

        def body(*args: Any) -> None:
            try:
                run(*args)
            except Exception as exc:
                failures.append(exc)

        return body

    stop = threading.Event()
    sweep_thread = threading.Thread(target=recorded(sweeper), args=(stop,))
    sweep_thread.start()
    threads = [threading.Thread(target=recorded(replica), args=(f"r{i}", i)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    sweep_thread.join()
    assert failures == []
    with psycopg.connect(url, autocommit=True) as conn:
        time.sleep(0.1)
        leases.sweep(conn)
        settled, leased, active = _state(conn)
        assert settled + leased <= limit and leased == active
        assert settled > 0
