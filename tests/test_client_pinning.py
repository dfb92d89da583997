"""zerohop.client keeps a thread and a chain of stored responses on the replica that holds
them: two replicas, each with its own SQLite store, so the other replica has neither (its
404). Each later turn's affinity is chosen to spread over both replicas (`question_for`), so
only the pinning keeps the turns together: the official SDKs' requests all succeed, and the
other replica is sent nothing. Streamed and whole answers alternate: the id is learned from
`message_start` / `response.created` and from a whole answer's body alike."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.live_server import MODEL_NAME, LiveServer, started_together
from zerohop.client import ReplicaPool, http_client
from zerohop.client.affinity import rank
from zerohop.client.surfaces import Messages

BETA = "message-threads-2026-08-12"
TURNS = 4


@pytest.fixture(scope="module")
def two_stores(
    llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[LiveServer]]:
    specs = {f"pinned{i}": ["--drain-seconds", "3"] for i in range(2)}
    with started_together(llama_dir, specs, tmp_path_factory) as servers:
        yield list(servers.values())


def question_for(pool: ReplicaPool, url: str, topic: str = "more") -> str:
    """A user turn whose prefix affinity ranks `url` first among the pool's replicas."""
    for i in range(10**4):
        question = f"Tell me {topic}, part {i}."
        text = Messages({"messages": [{"role": "user", "content": question}]}).affinity_text()
        if rank(pool.affinity.key(text), list(pool.replicas.values()))[0].url == url:
            return question
    raise AssertionError("no question ranks this replica first")


def _holder_and_other(pool: ReplicaPool) -> tuple[str, str]:
    """The replica that answered the first turn, and the other one."""
    (holder,) = [url for url, r in pool.replicas.items() if r.stats.requests]
    (other,) = [url for url in pool.replicas if url != holder]
    return holder, other


def _spread(pool: ReplicaPool, holder: str, other: str) -> list[str]:
    """TURNS questions ranking the other replica and the holder first, in turn."""
    return [question_for(pool, (other, holder)[i % 2], f"turn {i}") for i in range(TURNS)]


def test_a_thread_stays_on_its_replica(two_stores: list[LiveServer]) -> None:
    with ReplicaPool([s.url for s in two_stores], health_interval=0.5) as pool:
        client = anthropic.Anthropic(
            base_url="http://zerohop", api_key="unused", max_retries=0,
            http_client=http_client(pool=pool),
        )  # fmt: skip
        turn: Any = {"model": MODEL_NAME, "max_tokens": 2, "betas": [BETA]}
        first = client.beta.messages.create(
            **turn, system="You are terse.", messages=[{"role": "user", "content": "hi"}],
            thread={"type": "create"},
        )  # fmt: skip
        holder, other = _holder_and_other(pool)
        previous = first.id
        for i, question in enumerate(_spread(pool, holder, other)):
            continued = {
                **turn, "messages": [{"role": "user", "content": question}],
                "thread": {"type": "continue", "previous_message_id": previous},
            }  # fmt: skip
            if i % 2:
                answer = client.beta.messages.create(**continued)
            else:
                with client.beta.messages.stream(**continued) as stream:
                    answer = stream.get_final_message()
            assert answer.content, answer
            previous = answer.id
        stats = pool.stats()
    assert stats[holder]["requests"] == 1 + TURNS, stats
    assert stats[other]["requests"] == 0, stats


def test_a_response_chain_stays_on_its_replica(two_stores: list[LiveServer]) -> None:
    with ReplicaPool([s.url for s in two_stores], health_interval=0.5) as pool:
        client = openai.OpenAI(
            base_url="http://zerohop/v1", api_key="unused", max_retries=0,
            http_client=http_client(pool=pool),
        )  # fmt: skip
        turn: Any = {"model": MODEL_NAME, "max_output_tokens": 2}
        ids = [client.responses.create(**turn, instructions="Be terse.", input="hi").id]
        holder, other = _holder_and_other(pool)
        for i, question in enumerate(_spread(pool, holder, other)):
            chained = {**turn, "input": question, "previous_response_id": ids[-1]}
            if i % 2:
                ids.append(client.responses.create(**chained).id)
            else:
                events = list(client.responses.create(**chained, stream=True))
                assert events[-1].type in ("response.completed", "response.incomplete")
                ids.append(events[0].response.id)  # type: ignore[union-attr]
        items = client.responses.input_items.list(ids[-1])
        assert len(items.data) == 1 + 2 * TURNS, items  # each turn's input, each answer
        for response_id in ids:  # their paths' affinity spreads over both replicas too
            assert client.responses.retrieve(response_id).id == response_id
            client.responses.delete(response_id)
        stats = pool.stats()
    asked = 1 + TURNS + 1 + 2 * len(ids)  # the chain, input_items, retrieve and delete each
    assert stats[holder]["requests"] == asked, stats
    assert stats[other]["requests"] == 0, stats
