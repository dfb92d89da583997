"""Key changes reach every replica within a second (zerohop.gateway.store.pg_key_feed): two
Authenticators on one real PostgreSQL, as two replicas of a fleet, see a key created,
revoked or changed; a change that sent no notification is reconciled; a listener whose
connection is killed reconnects and catches up; through a PostgreSQL outage the last keys
keep being served from memory, and the change made at its end arrives."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.pg_fixtures import migrated_database, sql, wait_until
from tests.postgres_server import PostgresServer
from zerohop.gateway.auth import AuthenticationError, Authenticator
from zerohop.gateway.keys.identity import Budget, Limits, Tenant
from zerohop.gateway.store.open_store import StoreSpec
from zerohop.gateway.store.pg_key_feed import APPLICATION_NAME
from zerohop.gateway.store.postgres import PostgresStore
from zerohop.gateway.store.sqlite import KEY_ID_LENGTH
from zerohop.gateway.store.store import Store

WITHIN = 1.0  # seconds: the promise


@dataclass
class Fleet:
    url: str
    writer: PostgresStore  # as `zerohop keys --store` writes
    replicas: list[Authenticator]

    def accepted(self, secret: str) -> list[bool]:
        return [_accepts(r, secret) for r in self.replicas]


def _accepts(replica: Authenticator, secret: str) -> bool:
    """Served as this key (not as anonymous, as a replica with no keys serves anyone)."""
    try:
        return replica.authenticate(secret).key_id == secret[:KEY_ID_LENGTH]
    except AuthenticationError:
        return False


@pytest.fixture
def fleet(postgres: PostgresServer) -> Iterator[Fleet]:
    url = migrated_database(postgres)
    spec = StoreSpec.parse(url)
    stores = [Store.of(spec) for _ in "ab"]  # one per replica process
    fleet = Fleet(url, PostgresStore(url), [Authenticator(spec, s.keys) for s in stores])
    for replica in fleet.replicas:
        replica.load()
        replica.start_watching()
    wait_until(lambda: all(r.feed.up for r in fleet.replicas), 5)
    yield fleet
    for replica in fleet.replicas:
        replica.close()
    for store in stores:
        store.close()
    fleet.writer.close()


def test_a_created_key_is_accepted_by_every_replica_within_a_second(fleet: Fleet) -> None:
    secret, record = fleet.writer.create_key("acme", name="ci")
    assert wait_until(lambda: all(fleet.accepted(secret)), WITHIN) < WITHIN
    for replica in fleet.replicas:
        assert replica.identity_for(record.key_id).name == "ci"
        assert replica.version == fleet.writer.version()
        assert replica.feed.reloads["notify"] >= 1


def test_a_revoked_key_is_refused_by_every_replica_within_a_second(fleet: Fleet) -> None:
    secret, record = fleet.writer.create_key("acme")
    wait_until(lambda: all(fleet.accepted(secret)), WITHIN)
    fleet.writer.revoke_key(record.key_id)
    assert wait_until(lambda: not any(fleet.accepted(secret)), WITHIN) < WITHIN
    assert all(r.identity_for(record.key_id) is None for r in fleet.replicas)


def test_changed_limits_and_budgets_are_seen_within_a_second(fleet: Fleet) -> None:
    secret, record = fleet.writer.create_key("acme", limits=Limits(rpm=60))
    wait_until(lambda: all(fleet.accepted(secret)), WITHIN)
    fleet.writer.update_key(record.key_id, limits=Limits(rpm=7, otpm=900))
    fleet.writer.upsert_tenant(Tenant("acme", budget=Budget(5000, "day")))

    def seen() -> bool:
        identities = [r.authenticate(secret) for r in fleet.replicas]
        return all(
            i.limits == Limits(rpm=7, otpm=900) and i.tenant.budget == Budget(5000, "day")
            for i in identities
        )

    assert wait_until(seen, WITHIN) < WITHIN


def test_a_change_that_sent_no_notification_is_reconciled(fleet: Fleet) -> None:
    secret, record = fleet.writer.create_key("acme")
    wait_until(lambda: all(fleet.accepted(secret)), WITHIN)
    before = [r.feed.reloads["reconcile"] for r in fleet.replicas]
    by_hand = (
        f"UPDATE keys SET revoked = 1 WHERE key_id = '{record.key_id}';"
        " UPDATE store_meta SET value = value + 1 WHERE name = 'keys_version'"
    )
    sql(fleet.url, by_hand)
    # At most one reconciliation interval plus one notification wait.
    assert wait_until(lambda: not any(fleet.accepted(secret)), 2.0) < 1.6
    assert [r.feed.reloads["reconcile"] for r in fleet.replicas] > before


def test_a_killed_listener_reconnects_and_catches_up(fleet: Fleet) -> None:
    secret, record = fleet.writer.create_key("acme")
    wait_until(lambda: all(fleet.accepted(secret)), WITHIN)
    killed = sql(
        fleet.url,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        f" WHERE application_name = '{APPLICATION_NAME}' AND datname = current_database()",
    )
    assert killed == [(True,), (True,)]
    fleet.writer.revoke_key(record.key_id)  # while the listeners are gone: no notification
    assert wait_until(lambda: not any(fleet.accepted(secret)), WITHIN) < WITHIN
    wait_until(lambda: all(r.feed.up for r in fleet.replicas), WITHIN)
    for replica in fleet.replicas:
        assert replica.feed.errors >= 1 and replica.feed.last_error
        assert replica.feed.reloads["reconnect"] + replica.feed.reloads["notify"] >= 2


def test_an_outage_serves_the_last_keys_then_catches_up(
    postgres: PostgresServer, fleet: Fleet
) -> None:
    secret, record = fleet.writer.create_key("acme")
    wait_until(lambda: all(fleet.accepted(secret)), WITHIN)
    postgres.kill()
    try:
        wait_until(lambda: not any(r.feed.up for r in fleet.replicas), 2)
        started = time.monotonic()
        for _ in range(100):  # from memory: no lookup waits on the store
            assert all(fleet.accepted(secret))
        assert time.monotonic() - started < 0.1
        time.sleep(0.5)  # the feeds retry meanwhile, and keep serving
        assert all(fleet.accepted(secret))
    finally:
        postgres.start()
    fleet.writer.revoke_key(record.key_id)
    # The feeds' backoff has grown to at most 1.6 s by now; then a catch-up read.
    wait_until(lambda: not any(fleet.accepted(secret)), 5)
    wait_until(lambda: all(r.feed.up for r in fleet.replicas), 2)
    assert all(r.feed.reloads["reconnect"] + r.feed.reloads["notify"] >= 2 for r in fleet.replicas)
