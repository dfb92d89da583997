"""A fleet replica's leases go through its Store's lease repository (gateway/store/
lease_repository.py) on a real PostgreSQL: the keeper built from `Store.leases` renews its
replica on the repository's one `zerohop-leases` connection, the Store's close closes it, the
repository reopens it after it broke, and a SQLite store's repository says it cannot lease."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from tests.pg_fixtures import migrated_database, sql, wait_until
from tests.postgres_server import PostgresServer
from zerohop.gateway.budgets.lease_keeper import LeaseKeeper, open_leased_ledger
from zerohop.gateway.gateway import Gateway
from zerohop.gateway.store.lease_repository import APPLICATION_NAME, NotAFleetStore
from zerohop.gateway.store.spec import StoreSpec
from zerohop.gateway.store.store import Store


@pytest.fixture
def url(postgres: PostgresServer) -> str:
    return migrated_database(postgres)


def _lease_connections(url: str) -> int:
    rows = sql(
        url,
        "SELECT count(*) FROM pg_stat_activity"
        f" WHERE application_name = '{APPLICATION_NAME}' AND datname = current_database()",
    )
    return int(rows[0][0])


def _heartbeat_at(url: str, replica_id: str) -> object:
    rows = sql(url, f"SELECT heartbeat_at FROM replicas WHERE replica_id = '{replica_id}'")
    return rows[0][0] if rows else None


def test_the_keeper_renews_through_the_stores_repository_and_the_store_closes_it(
    url: str,
) -> None:
    store = Store.of(StoreSpec.parse(url))
    ledger = open_leased_ledger(store.leases, ttl=6.0, heartbeat=0.1)
    keeper = ledger.keeper
    assert isinstance(keeper, LeaseKeeper) and keeper.leases is store.leases
    ledger.start()
    try:
        wait_until(lambda: _heartbeat_at(url, keeper.replica_id) is not None, 5.0)
        first = _heartbeat_at(url, keeper.replica_id)
        wait_until(lambda: _heartbeat_at(url, keeper.replica_id) != first, 5.0)  # renewed
        assert _lease_connections(url) == 1
    finally:
        ledger.close()
    assert _heartbeat_at(url, keeper.replica_id) is None  # its goodbye, through the repository
    assert _lease_connections(url) == 1  # the store's connection: the keeper leaves it open
    store.close()
    wait_until(lambda: _lease_connections(url) == 0, 5.0)


def test_a_fleet_gateway_keeps_its_leases_through_its_store(url: str) -> None:
    gateway = Gateway.from_store(StoreSpec.parse(url))
    keeper = getattr(gateway.ledger, "keeper", None)
    assert isinstance(keeper, LeaseKeeper)
    assert keeper.leases is gateway.store.leases
    gateway.store.close()


def test_the_repository_reopens_its_connection_after_it_broke(url: str) -> None:
    store = Store.of(StoreSpec.parse(url))
    leases = store.leases
    try:
        share, fresh = leases.rebalance("r1", "key:x", 1.0, 30)
        assert share == pytest.approx(1.0) and fresh
        sql(
            url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            f" WHERE application_name = '{APPLICATION_NAME}' AND datname = current_database()",
        )
        with pytest.raises(psycopg.Error):  # the keeper's backoff catches it
            leases.heartbeat("r1", 30, "host", "test")
        beat = leases.heartbeat("r1", 30, "host", "test")  # on a fresh connection
        assert beat.replicas == 1 and beat.renewed == {}
        leases.forget_replica("r1")
        assert sql(url, "SELECT count(*) FROM rate_shares") == [(0,)]
    finally:
        store.close()


def test_a_sqlite_stores_repository_cannot_lease(tmp_path: Path) -> None:
    store = Store.of(StoreSpec.sqlite(tmp_path / "keys.db"))  # building it opens nothing
    with pytest.raises(NotAFleetStore, match="not a PostgreSQL store"):
        store.leases.sweep()
    store.close()
