"""The PostgreSQL harness itself (tests/postgres_server.py), which issue 24's store tests stand
on: a real server that connects, keeps committed data across a clean restart, and recovers
after SIGKILL (an outage) with nothing committed lost."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from tests.postgres_server import PostgresServer, require_postgres


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with PostgresServer(require_postgres()) as server:
        yield server


def _count(url: str) -> int:
    with psycopg.connect(url) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS harness (n int)")
        return conn.execute("SELECT count(*) FROM harness").fetchone()[0]


def test_connects_over_tcp_and_unix_socket(postgres: PostgresServer) -> None:
    assert postgres.url.startswith("postgresql://")
    for url in (postgres.url, postgres.socket_url):
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
            assert conn.execute("SHOW fsync").fetchone() == ("on",)


def test_stop_then_start_keeps_data(postgres: PostgresServer) -> None:
    before = _count(postgres.url)
    with psycopg.connect(postgres.url, autocommit=True) as conn:
        conn.execute("INSERT INTO harness SELECT generate_series(1, 100)")
    port = postgres.port
    postgres.stop()
    assert not postgres.running
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(postgres.url, connect_timeout=2)
    postgres.start()
    assert postgres.port == port
    assert _count(postgres.url) == before + 100


def test_kill_then_start_recovers_committed_rows(postgres: PostgresServer) -> None:
    before = _count(postgres.url)
    open_conn = psycopg.connect(postgres.url, autocommit=True)  # a client caught by the outage
    open_conn.execute("INSERT INTO harness VALUES (1)")
    postgres.kill()
    try:
        with pytest.raises(psycopg.OperationalError):
            open_conn.execute("SELECT 1")
    finally:  # the server is the session's: the tests after this one need it back
        open_conn.close()
        postgres.start()
    assert _count(postgres.url) == before + 1
    assert "database system was interrupted" in postgres.log()
