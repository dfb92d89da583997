"""Three real `zerohop serve` replicas on one real PostgreSQL (`--store`, from ZEROHOP_STORE):
one key created once works on all three within a second and stops within a second of its
revocation; 48 budgeted streams spread by zerohop.client never spend past the tenant's
budget; with PostgreSQL stopped, replicas serve inside their leases and unbudgeted keys,
and refuse the rest as retryable; a replica SIGKILLed with a lease has it charged at TTL
by a survivor."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import psycopg
import pytest

from tests.live_server import MODEL_NAME, LiveServer, fleet_of
from tests.pg_fixtures import wait_until
from tests.postgres_server import PostgresServer
from zerohop.client import ReplicaPool, async_http_client
from zerohop.gateway.keys.identity import Budget, Tenant
from zerohop.gateway.store.postgres import PostgresStore

LEASE_TTL = 3.0  # seconds: a killed replica's lease is charged this soon
# The first replica's: longer than any outage test can take, however loaded the machine, so a
# request "inside the lease it holds" is inside it because of what happened, not how fast.
OUTAGE_LEASE_TTL = 600.0
MAX_TOKENS = 16
BUDGET = 6_000


@pytest.fixture(scope="module")
def fleet(
    llama_dir: Path, store_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[LiveServer]]:
    ttls = [OUTAGE_LEASE_TTL, LEASE_TTL, LEASE_TTL]
    args = [["--lease-ttl", str(ttl)] for ttl in ttls]
    with fleet_of(llama_dir, store_url, args, lambda: tmp_path_factory.mktemp("fleet")) as f:
        yield f


@pytest.fixture
def store(store_url: str) -> Iterator[PostgresStore]:
    store = PostgresStore(store_url)
    yield store
    store.close()


def _ask(server: LiveServer, key: str, max_tokens: int = 4) -> httpx.Response:
    body = {
        "model": MODEL_NAME,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}],
    }
    return httpx.post(
        server.url + "/v1/messages", json=body, headers={"x-api-key": key}, timeout=30
    )


def _status_everywhere(fleet: list[LiveServer], key: str, status: int) -> float:
    return max(
        wait_until(lambda s=server: _ask(s, key, 1).status_code == status, 5.0, 0.02)
        for server in fleet
    )


def test_a_key_created_once_works_everywhere_and_its_revocation_too(
    fleet: list[LiveServer], store: PostgresStore
) -> None:
    started = time.monotonic()
    key, record = store.create_key("everywhere")
    _status_everywhere(fleet, key, 200)
    assert time.monotonic() - started < 1.0 + 3 * 0.5  # within 1 s, plus the answers' time
    started = time.monotonic()
    assert store.revoke_key(record.key_id)
    _status_everywhere(fleet, key, 401)
    assert time.monotonic() - started < 1.0 + 3 * 0.1


def test_the_admin_api_of_any_replica_sees_the_fleet(
    fleet: list[LiveServer], store: PostgresStore
) -> None:
    admin_key, _ = store.create_key("ops", admin=True, inference=False)
    admin = {"x-api-key": admin_key}
    made = httpx.post(fleet[0].url + "/v1/admin/keys", json={"tenant": "seen"}, headers=admin)
    assert made.status_code == 201, made.text
    secret, key_id = made.json()["secret"], made.json()["api_key"]["id"]
    wait_until(lambda: _ask(fleet[1], secret, 3).status_code == 200, 5.0, 0.05)
    start = time.strftime("%Y-%m-%dT00:00:00Z", time.gmtime())
    params = {"starting_at": start, "group_by[]": "api_key_id", "api_key_ids[]": key_id}

    def reported() -> int:  # on the third replica: the rows the second one wrote
        report = httpx.get(
            fleet[2].url + "/v1/organizations/usage_report/messages", params=params, headers=admin
        ).json()
        return sum(r["output_tokens"] for b in report["data"] for r in b["results"])

    wait_until(lambda: reported() >= 3, 5.0, 0.1)
    listed = httpx.get(fleet[1].url + "/v1/organizations/api_keys", headers=admin).json()
    assert key_id in [k["id"] for k in listed["data"]]
    assert _ask(fleet[0], admin_key).status_code == 403  # an admin key: not the model
    budgets = httpx.get(fleet[1].url + "/v1/admin/budgets", headers=admin)
    assert budgets.status_code == 200, budgets.text  # the fleet's spend: the store's


def _usage(store_url: str, subject: str) -> tuple[int, int]:
    with psycopg.connect(store_url) as conn:
        row = conn.execute(
            "SELECT settled, leased FROM budget_state WHERE subject = %s", (subject,)
        ).fetchone()
    return row or (0, 0)


async def _spend_budget(fleet: list[LiveServer], key: str, streams: int) -> dict[str, int]:
    pool = ReplicaPool([server.url for server in fleet])
    client = anthropic.AsyncAnthropic(
        base_url="http://zerohop",
        api_key=key,
        max_retries=0,
        http_client=async_http_client(pool=pool),
    )
    seen = {"tokens": 0, "answers": 0, "exhausted": 0, "retried": 0}

    async def worker(n: int) -> None:
        for _ in range(200):
            try:
                message = await client.messages.create(
                    model=MODEL_NAME,
                    max_tokens=MAX_TOKENS,
                    extra_body={"temperature": 0},
                    messages=[{"role": "user", "content": f"count to {n}"}],
                )
            except anthropic.RateLimitError:  # 429 insufficient_quota: the budget is spent
                seen["exhausted"] += 1
                return
            except anthropic.APIStatusError as exc:  # 529: the rest is leased elsewhere
                assert exc.status_code in (503, 529), exc
                seen["retried"] += 1
                await asyncio.sleep(0.2)
                continue
            seen["answers"] += 1
            seen["tokens"] += message.usage.input_tokens + message.usage.output_tokens
        raise AssertionError("the budget never ran out")

    try:
        await asyncio.gather(*(worker(n) for n in range(streams)))
    finally:
        await client.close()
    return seen


def test_48_streams_over_three_replicas_never_pass_the_budget(
    fleet: list[LiveServer], store: PostgresStore, store_url: str
) -> None:
    store.upsert_tenant(Tenant("budgeted", budget=Budget(BUDGET, "total")))
    key, _ = store.create_key("budgeted")
    _status_everywhere(fleet, key, 200)
    seen = asyncio.run(_spend_budget(fleet, key, 48))
    settled, leased = _usage(store_url, "tenant:budgeted")
    # What the clients were served, by their own count, is inside what the fleet charged.
    assert seen["tokens"] <= settled + leased <= BUDGET
    assert seen["tokens"] >= 0.95 * BUDGET, seen  # nearly all of it was usable
    assert seen["exhausted"] == 48


def test_store_down_serves_leases_and_unbudgeted_keys(
    fleet: list[LiveServer], store: PostgresStore, postgres: PostgresServer, store_url: str
) -> None:
    store.upsert_tenant(Tenant("outage", budget=Budget(1_000_000, "total")))
    budgeted, _ = store.create_key("outage")
    free, _ = store.create_key("unmetered")
    server = fleet[0]
    _status_everywhere([server], free, 200)
    for _ in range(5):  # a lease sized from this spend
        assert _ask(server, budgeted, MAX_TOKENS).status_code == 200
    postgres.stop()
    try:
        wait_until(lambda: "zerohop_store_up 0.0" in _metrics(server), 10.0, 0.1)
        assert _ask(server, free).status_code == 200
        assert _ask(server, budgeted).status_code == 200  # inside the lease it holds
        statuses = [_ask(server, budgeted, 2000).status_code for _ in range(3)]
        assert 529 in statuses  # a request the lease cannot cover: retryable, not admitted
    finally:
        postgres.start()
    wait_until(lambda: "zerohop_store_up 1.0" in _metrics(server), 15.0, 0.1)
    settled, leased = _usage(store_url, "tenant:outage")
    assert settled + leased <= 1_000_000


def _metrics(server: LiveServer) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def test_a_killed_replicas_lease_is_charged_at_ttl(
    fleet: list[LiveServer], store: PostgresStore, store_url: str
) -> None:
    store.upsert_tenant(Tenant("killed", budget=Budget(500_000, "total")))
    key, _ = store.create_key("killed")
    victim = fleet[-1]
    _status_everywhere([victim], key, 200)
    assert _ask(victim, key, MAX_TOKENS).status_code == 200

    def victim_leases(state: str) -> int:
        with psycopg.connect(store_url) as conn:
            (count,) = conn.execute(
                "SELECT count(*) FROM leases WHERE subject = 'tenant:killed' AND state = %s",
                (state,),
            ).fetchone()
        return count

    assert victim_leases("active") == 1
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait()
    waited = wait_until(lambda: victim_leases("expired") == 1, 3 * LEASE_TTL, 0.1)
    assert waited >= LEASE_TTL / 2  # not before its TTL
    assert victim_leases("active") == 0
    settled, leased = _usage(store_url, "tenant:killed")
    assert leased == 0 and 0 < settled <= 500_000
