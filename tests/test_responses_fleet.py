"""Background responses in a fleet: two real `zerohop serve` replicas on one real PostgreSQL
(`ZEROHOP_STORE`), a short `--lease-ttl` and slowed engine steps, driven by the official
OpenAI SDK. A cancel sent to the replica not running the response stops the generation on
the one that is; a replica SIGKILLed mid-run has its response reported `failed` by the other
once the lease ends, where it would otherwise stay `in_progress` for 30 days. The lease
table's own rules run on both stores without servers."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.live_server import MODEL_NAME, LiveServer, fleet_of
from tests.pg_fixtures import wait_until
from zerohop.api.responses.leases import STOPPED
from zerohop.api.responses.stored import StoredResponses
from zerohop.gateway.store.postgres import PostgresStore
from zerohop.gateway.store.repositories import ResponseRepository
from zerohop.gateway.store.response_tables import Lease, ResponseRow
from zerohop.gateway.store.sqlite import KeyStore

LEASE_TTL = 2.0  # seconds (the flag's least): a dead replica's response fails this soon
SLOW = ["--debug-step-delay", "0.05"]  # a long answer runs for tens of seconds


@pytest.fixture(scope="module")
def fleet(
    llama_dir: Path, store_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[LiveServer]]:
    args = [["--lease-ttl", str(LEASE_TTL), *SLOW]] * 2
    with fleet_of(llama_dir, store_url, args, lambda: tmp_path_factory.mktemp("respfleet")) as f:
        yield f


@pytest.fixture(scope="module")
def key(store_url: str) -> str:
    store = PostgresStore(store_url)
    try:
        secret, _ = store.create_key("responder")
    finally:
        store.close()
    return secret


def sdk(server: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def running(server: LiveServer) -> float:
    """The engine's running requests on `server`, from its /metrics."""
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:num_requests_running in /metrics")


def start_long(server: LiveServer, key: str) -> str:
    """A background response running on `server`'s engine."""
    made = sdk(server, key).responses.create(
        model=MODEL_NAME,
        input="count slowly",
        background=True,
        max_output_tokens=2000,
        temperature=0,
    )
    assert made.status == "queued"
    wait_until(lambda: running(server) == 1, 30.0, 0.1)
    return made.id


def test_a_cancel_on_another_replica_stops_the_generation_where_it_runs(
    fleet: list[LiveServer], key: str
) -> None:
    owner, other = fleet
    response_id = start_long(owner, key)
    cancelled = sdk(other, key).responses.cancel(response_id)
    assert (cancelled.id, cancelled.status) == (response_id, "cancelled")
    wait_until(lambda: running(owner) == 0, 20.0, 0.1)  # ~40 s of tokens were left
    for server in fleet:
        assert sdk(server, key).responses.retrieve(response_id).status == "cancelled"


def test_a_killed_replicas_response_fails_on_the_other_within_the_lease(
    fleet: list[LiveServer], key: str
) -> None:
    victim, survivor = fleet
    response_id = start_long(victim, key)
    assert sdk(survivor, key).responses.retrieve(response_id).status in ("queued", "in_progress")
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait()

    def failed() -> bool:
        return sdk(survivor, key).responses.retrieve(response_id).status == "failed"

    wait_until(failed, LEASE_TTL * 5, 0.2)
    seen = sdk(survivor, key).responses.retrieve(response_id)
    assert seen.error is not None and seen.error.code == "server_error"
    assert seen.error.message == "the replica running this response stopped"
    assert sdk(survivor, key).responses.cancel(response_id).status == "failed"  # as it ended


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    if request.param == "sqlite":
        db: Any = KeyStore(tmp_path / "keys.db")
    else:
        from tests.pg_fixtures import migrated_database  # a database no replica sweeps

        db = PostgresStore(migrated_database(request.getfixturevalue("postgres")))
    yield db
    db.close()


def _row(response_id: str, owner: str, until: float) -> ResponseRow:
    body = orjson.dumps({"id": response_id, "status": "in_progress"}).decode()
    return ResponseRow(response_id, "acme", "in_progress", body, "[]", 1e12, Lease(owner, until))


def test_leases_renew_name_the_stopped_and_expire(database: Any) -> None:
    database.put_response(_row("resp_a", "one", 110.0), 100.0)
    database.put_response(_row("resp_b", "one", 110.0), 100.0)
    database.put_response(_row("resp_c", "two", 105.0), 100.0)
    assert database.get_response("acme", "resp_a", 101.0).lease_until == 110.0
    assert database.set_response_status("acme", "resp_b", "cancelled", None, 101.0)
    assert database.renew_response_leases("one", 120.0, 102.0) == ["resp_b"]
    assert database.get_response("acme", "resp_a", 102.0).lease_until == 120.0
    assert database.get_response("acme", "resp_b", 102.0).lease_until is None
    assert database.expired_responses(104.0) == []
    (expired,) = database.expired_responses(106.0)  # two's lease ended
    assert (expired.tenant, expired.response_id) == ("acme", "resp_c")
    assert database.set_response_status("acme", "resp_c", "failed", None, 106.0)
    assert database.expired_responses(107.0) == []  # and its ended lease is dropped
    assert database.get_response("acme", "resp_c", 107.0).lease_until is None
    database.release_response_lease("resp_a")
    assert database.get_response("acme", "resp_a", 107.0).lease_until is None


def test_a_sqlite_servers_start_fails_what_its_last_process_left_running(tmp_path: Path) -> None:
    """One server per SQLite file: the responses leased by a process that crashed are
    failed when the next one starts, and a read of an expired lease fails it at once."""
    db = KeyStore(tmp_path / "keys.db")
    repository = ResponseRepository(lambda: db)
    db.put_response(_row("resp_old", "crashed", 9e11), 100.0)  # lease far from its end
    db.put_response(_row("resp_read", "crashed", 50.0), 10.0)
    now = [60.0]
    stored = StoredResponses(repository, clock=lambda: now[0])

    async def run() -> tuple[str, str]:
        found = await stored.get("acme", "resp_read")  # its lease ended at 50
        await stored.leases.start(recover=True)
        await stored.leases.stop()
        return found.status, (await stored.get("acme", "resp_old")).status

    assert asyncio.run(run()) == ("failed", "failed")
    kept = orjson.loads(db.get_response("acme", "resp_old", 61.0).body)
    assert kept["error"] == {"code": "server_error", "message": STOPPED}
    assert db.get_response("acme", "resp_old", 61.0).status == "failed"
    db.close()
