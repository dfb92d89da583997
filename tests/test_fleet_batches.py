"""Batches in the fleet store: three real `zerohop serve` replicas on one real PostgreSQL
(`ZEROHOP_STORE`), driven by the official SDKs. A batch made on one replica is read, listed,
cancelled and its results fetched on the others; a replica SIGKILLed while it runs lines has
them finished by the others after the lease TTL, one result each; a rolling restart of all
three loses no batch and no stored response."""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import psycopg
import pytest

from tests.live_server import MODEL_NAME, LiveServer, fleet_of
from tests.pg_fixtures import wait_until
from zerohop.gateway.store.postgres import PostgresStore

LEASE_TTL = 2.0  # seconds: a killed replica's lines run elsewhere this soon (the flag's least)


@pytest.fixture(scope="module")
def fleet(
    llama_dir: Path, store_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[LiveServer]]:
    args = [["--lease-ttl", str(LEASE_TTL)]] * 3
    with fleet_of(llama_dir, store_url, args, lambda: tmp_path_factory.mktemp("batchfleet")) as f:
        yield f


@pytest.fixture(scope="module")
def key(store_url: str) -> str:
    store = PostgresStore(store_url)
    try:
        secret, _ = store.create_key("batcher")
    finally:
        store.close()
    return secret


def sdk(server: LiveServer, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def requests(count: int, max_tokens: int, prefix: str = "line") -> list[dict]:
    params = {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0}
    return [
        {
            "custom_id": f"{prefix}-{i}",
            "params": {**params, "messages": [{"role": "user", "content": f"count {i}"}]},
        }
        for i in range(count)
    ]


def ended(client: anthropic.Anthropic, batch_id: str, timeout: float = 120.0) -> None:
    wait_until(
        lambda: client.messages.batches.retrieve(batch_id).processing_status == "ended",
        timeout,
        0.2,
    )


def results(client: anthropic.Anthropic, batch_id: str) -> Counter:
    return Counter((r.custom_id, r.result.type) for r in client.messages.batches.results(batch_id))


def test_a_batch_made_on_one_replica_is_served_by_every_other(
    fleet: list[LiveServer], key: str
) -> None:
    made = sdk(fleet[0], key).messages.batches.create(requests=requests(6, 4))
    for server in fleet[1:]:
        seen = sdk(server, key).messages.batches.retrieve(made.id)
        assert (seen.id, seen.created_at) == (made.id, made.created_at)
        assert made.id in [b.id for b in sdk(server, key).messages.batches.list(limit=20)]
    ended(sdk(fleet[1], key), made.id)
    for server in fleet:
        got = results(sdk(server, key), made.id)
        assert got == Counter({(f"line-{i}", "succeeded"): 1 for i in range(6)}), got

    doomed = sdk(fleet[0], key).messages.batches.create(requests=requests(40, 16, "doomed"))
    canceling = sdk(fleet[2], key).messages.batches.cancel(doomed.id)
    assert canceling.processing_status in ("canceling", "ended")
    ended(sdk(fleet[1], key), doomed.id)
    kinds = Counter(kind for _, kind in results(sdk(fleet[1], key), doomed.id).elements())
    assert kinds["canceled"] > 0 and sum(kinds.values()) == 40, kinds


def _owners(store_url: str, batch_id: str) -> set[str]:
    with psycopg.connect(store_url) as conn:
        rows = conn.execute(
            "SELECT DISTINCT lease_owner FROM lines WHERE batch_id = %s AND state = 'running'",
            (batch_id,),
        ).fetchall()
    return {owner for (owner,) in rows if owner}


def _lines_of(store_url: str, batch_id: str, owner: str) -> list[int]:
    with psycopg.connect(store_url) as conn:
        rows = conn.execute(
            "SELECT idx FROM lines WHERE batch_id = %s AND state = 'running' AND lease_owner = %s",
            (batch_id, owner),
        ).fetchall()
    return [index for (index,) in rows]


def _stop_a_replica_holding_lines(
    fleet: list[LiveServer], store_url: str, batch_id: str
) -> tuple[LiveServer, str]:
    """A replica running lines of the batch, stopped (SIGSTOP) so that it holds them until it
    is killed, and its lease owner id (which carries its API process's pid). A replica that
    ended its last line just before the stop is let go and another looked for."""
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        for server in fleet:
            mark = f"-{server.process.pid}-"
            if not any(mark in o for o in _owners(store_url, batch_id)):
                continue
            server.process.send_signal(signal.SIGSTOP)
            held = [o for o in _owners(store_url, batch_id) if mark in o]
            if held:
                return server, held[0]
            server.process.send_signal(signal.SIGCONT)
        time.sleep(0.02)
    raise AssertionError("no replica ran the batch's lines within 60 s")


def test_a_killed_replicas_lines_finish_on_the_others_once_each(
    fleet: list[LiveServer], key: str, store_url: str
) -> None:
    count = 60
    made = sdk(fleet[0], key).messages.batches.create(requests=requests(count, 48, "kill"))
    victim, owner = _stop_a_replica_holding_lines(fleet, store_url, made.id)
    orphans = _lines_of(store_url, made.id, owner)
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait()
    killed_at = time.monotonic()
    assert orphans, "the victim held lines when it died"
    wait_until(lambda: not _lines_of(store_url, made.id, owner), 60.0, 0.02)
    resumed_after = time.monotonic() - killed_at  # its lines run (or ran) elsewhere
    print(f"\n{len(orphans)} lines of the killed replica resumed after {resumed_after:.2f} s")
    survivors = [s for s in fleet if s is not victim]
    ended(sdk(survivors[0], key), made.id, timeout=180.0)
    got = results(sdk(survivors[1], key), made.id)
    assert got == Counter({(f"kill-{i}", "succeeded"): 1 for i in range(count)}), got
    assert resumed_after >= LEASE_TTL / 2  # its lines waited for their lease to end
    victim.start(victim.log_path)  # back for the next test


def test_a_rolling_restart_loses_no_batch_and_no_stored_response(
    fleet: list[LiveServer], key: str
) -> None:
    made = sdk(fleet[0], key).messages.batches.create(requests=requests(30, 32, "roll"))
    oa = openai.OpenAI(base_url=fleet[1].url + "/v1", api_key=key, max_retries=0)
    stored = oa.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=4, store=True)
    for server in fleet:
        server.stop()
        server.start(server.log_path)
    ended(sdk(fleet[2], key), made.id, timeout=180.0)
    got = results(sdk(fleet[0], key), made.id)
    assert got == Counter({(f"roll-{i}", "succeeded"): 1 for i in range(30)}), got
    for server in fleet:
        again = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        assert again.responses.retrieve(stored.id).output_text == stored.output_text
