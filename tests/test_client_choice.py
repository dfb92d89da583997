"""zerohop.client's replica choice: rendezvous prefix affinity, bounded by load, and the
per-replica circuit breaker; then the load a real server reports, read back."""

from __future__ import annotations

import random
from collections import Counter

import httpx
import pytest

from zerohop.client.affinity import AffinityPolicy, rank
from zerohop.client.replica import CLOSED, HALF_OPEN, OPEN, CircuitBreaker, Replica

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 4)]
SYSTEM = "You are a careful assistant. " * 80  # 2.3k characters: longer than the key


def replicas() -> list[Replica]:
    return [Replica(url) for url in URLS]


def conversation(team: int, turn: str) -> str:
    return f"Team {team}. {SYSTEM}User: {turn}"


def test_a_shared_prefix_keeps_its_replica() -> None:
    policy, pool = AffinityPolicy(), replicas()
    chosen = {policy.choose(conversation(7, f"question {i}"), pool)[0].url for i in range(20)}
    assert len(chosen) == 1, "prompts sharing their first blocks hash alike"


def test_prefixes_spread_over_the_replicas() -> None:
    policy, pool = AffinityPolicy(), replicas()
    counts = Counter(policy.choose(conversation(team, "hi"), pool)[0].url for team in range(300))
    assert set(counts) == set(URLS)
    assert min(counts.values()) > 60, counts  # ~100 each


def test_a_leaving_replica_moves_only_its_own_prefixes() -> None:
    keys = [AffinityPolicy().key(conversation(team, "hi")) for team in range(200)]
    pool = replicas()
    before = {k: rank(k, pool)[0].url for k in keys}
    after = {k: rank(k, pool[:2])[0].url for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == URLS[2] for k in moved)


def test_load_overrides_affinity_only_when_well_above_the_others() -> None:
    pool = replicas()
    prompt = conversation(3, "hi")

    def place(rng: random.Random | None = None) -> tuple[Replica, bool]:
        return AffinityPolicy().choose(prompt, pool, rng)  # a new prefix: no memory of it

    preferred, by_affinity = place()
    assert by_affinity
    preferred.queue_wait_ms = 900.0  # within the slack: affinity holds
    assert place() == (preferred, True)
    for other in pool:
        other.queue_wait_ms = 3000.0 if other is not preferred else 6500.0
    assert place() == (preferred, True), "all busy: no reason to move"
    for other in pool:
        other.queue_wait_ms = 0.0 if other is not preferred else 5000.0
    chosen, by_affinity = place(random.Random(1))
    assert chosen is not preferred and not by_affinity
    preferred.queue_wait_ms = 0.0
    preferred.in_flight = 10  # this client's own requests count too
    assert place(random.Random(2))[0] is not preferred


def test_a_placed_conversation_stays_where_its_prefix_is_cached() -> None:
    policy, pool = AffinityPolicy(), replicas()
    preferred = rank(policy.key(conversation(5, "hi")), pool)[0]
    preferred.in_flight = 10  # load places the conversation elsewhere
    placed, by_affinity = policy.choose(conversation(5, "first turn"), pool, random.Random(3))
    assert placed is not preferred and not by_affinity
    preferred.in_flight = 0
    placed.queue_wait_ms = 60_000.0  # later turns stay with the cache, however busy
    for turn in range(5):
        assert policy.choose(conversation(5, f"turn {turn}"), pool) == (placed, True)
    placed.breaker.failed(), placed.breaker.failed(), placed.breaker.failed()
    assert policy.choose(conversation(5, "after"), pool)[0] is not placed, "unless it is down"
    small = AffinityPolicy(remember=2)
    for team in range(3):
        small.choose(conversation(team, "hi"), pool)
    assert len(small.placed) == 2


def test_an_open_breaker_takes_a_replica_out_until_its_probe() -> None:
    breaker = CircuitBreaker(failure_threshold=3, reset_after=5.0)
    for _ in range(2):
        breaker.failed(now=0.0)
    assert breaker.allows(now=0.0) and breaker.state == CLOSED
    breaker.failed(now=1.0)
    assert breaker.state == OPEN and not breaker.allows(now=3.0)
    assert breaker.allows(now=6.5) and breaker.state == HALF_OPEN
    breaker.failed(now=6.6)
    assert breaker.state == OPEN and not breaker.allows(now=7.0), "a failed probe reopens it"
    assert breaker.allows(now=12.0)
    breaker.succeeded()
    assert breaker.state == CLOSED and breaker.failures == 0

    policy, pool = AffinityPolicy(), replicas()
    prompt = conversation(5, "hi")
    preferred = policy.choose(prompt, pool)[0]
    for _ in range(3):
        preferred.breaker.failed()
    assert policy.choose(prompt, pool)[0] is not preferred
    for replica in pool:
        replica.breaker.state, replica.breaker.opened_at = OPEN, 1e18
    with pytest.raises(LookupError):
        policy.choose(prompt, pool)


def test_a_replica_reads_the_load_a_server_reports(live_server) -> None:
    replica = Replica(live_server.url)
    response = httpx.get(live_server.url + "/v1/models")
    replica.observe(response.headers)
    assert response.headers["zerohop-running"] == str(replica.running) == "0"
    assert replica.kv_usage == 0.0
    replica.observe({"zerohop-queue-wait-ms": "120", "zerohop-waiting": "bad"})
    assert replica.queue_wait_ms == 120.0 and replica.waiting == 0


def test_a_ready_health_answer_closes_a_breaker_left_half_open() -> None:
    from zerohop.client.health import set_ready

    replica = Replica(URLS[0], breaker=CircuitBreaker(failure_threshold=1, reset_after=0.0))
    replica.breaker.failed()
    assert replica.usable  # due for its probe: choosing lets it into half-open...
    assert replica.breaker.state == HALF_OPEN and not replica.usable  # ...and nobody picked it
    set_ready(replica, True)
    assert replica.breaker.state == CLOSED and replica.usable
    replica.breaker.failed()
    set_ready(replica, False)
    assert replica.breaker.state == OPEN and not replica.usable
