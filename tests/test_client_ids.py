"""After a mid-stream failover the ids the caller holds stay true: two replicas of the tiny
llama share one real PostgreSQL store (`--store`, a fleet), and the official SDKs stream
through zerohop.client.

- A Responses stream whose engine dies mid-answer (`response.failed`, `server_error`) goes on
  on the other replica, and the response is kept under the id the caller has: `retrieve`
  finds it completed, not the first replica's `failed` one.
- A Responses stream whose replica is SIGKILLed mid-answer is kept under the caller's id:
  `retrieve` and a `previous_response_id` turn with it succeed, and the client's pin names
  the continuing replica. A continuation may not take the id of a kept response (400).
- A Responses stream cut after `response.created`, before any token, starts over under the
  caller's id.
- A thread turn cut after `message_start` and before any text starts over on another URL,
  and the caller holds the id that turn is kept under: continuing from it succeeds.

The engines sleep a little after each step, so a stream is still being decoded when its
replica (or its engine) dies.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.cutting_proxy import cutting_proxy
from tests.live_server import MODEL_NAME, LiveServer, kill_busy, started_together
from tests.pg_fixtures import wait_until
from tests.test_client_pinning import question_for
from tests.test_engine_supervision import engine_pid
from zerohop.client import ReplicaPool, http_client
from zerohop.gateway.store.postgres import PostgresStore

STEP_DELAY = "0.01"  # seconds each engine sleeps after a step
GREEDY: dict[str, Any] = {
    "model": MODEL_NAME,
    "input": "Tell me a story about a lighthouse.",
    "max_output_tokens": 48,
    "temperature": 0,
}
BETA = "message-threads-2026-08-12"


@pytest.fixture(scope="module")
def shared_store(
    llama_dir: Path, store_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[LiveServer]]:
    specs = {f"ids{i}": ["--store", store_url, "--debug-step-delay", STEP_DELAY] for i in range(2)}
    with started_together(llama_dir, specs, tmp_path_factory) as servers:
        yield list(servers.values())


@pytest.fixture(scope="module")
def key(store_url: str) -> str:
    store = PostgresStore(store_url)
    try:
        secret, _ = store.create_key("ids")
    finally:
        store.close()
    return secret


def openai_sdk(pool: ReplicaPool, key: str) -> openai.OpenAI:
    http = http_client(pool=pool)
    return openai.OpenAI(base_url="http://zerohop/v1", api_key=key, max_retries=0, http_client=http)


def streamed(client: openai.OpenAI, cut: Any) -> list[Any]:
    """A streamed greedy response's events; `cut()` runs after its third text delta."""
    events, deltas = [], 0
    for event in client.responses.create(**GREEDY, stream=True):
        events.append(event)
        deltas += event.type == "response.output_text.delta"
        if deltas == 3 and event.type == "response.output_text.delta":
            cut()
    return events


def check_one_stream(events: list[Any], whole: Any) -> str:
    """The stream is one response equal to `whole` (as uninterrupted); its id."""
    assert events[-1].type == "response." + whole.status
    assert not any(e.type in ("response.failed", "error") for e in events)
    first, final = events[0].response, events[-1].response
    assert final.id == first.id
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == whole.output_text != ""
    return str(final.id)


def test_a_failed_response_fails_over_and_is_kept_under_the_callers_id(
    shared_store: list[LiveServer], key: str
) -> None:
    with ReplicaPool([s.url for s in shared_store], health_interval=0.5) as pool:
        client = openai_sdk(pool, key)
        whole = client.responses.create(**GREEDY)
        victim: list[LiveServer] = []

        def kill_engine() -> None:
            (busy,) = [s for s in shared_store if pool.replicas[s.url].in_flight]
            victim.append(busy)
            os.kill(engine_pid(busy), signal.SIGKILL)

        events = streamed(client, kill_engine)
        assert pool.stats()[victim[0].url]["resumes"] == 1
        response_id = check_one_stream(events, whole)
        kept = client.responses.retrieve(response_id)
    assert kept.status == whole.status and kept.error is None
    assert kept.output_text == whole.output_text


def test_a_resumed_response_is_kept_under_the_callers_id(
    shared_store: list[LiveServer], key: str
) -> None:
    for server in shared_store:  # the engine the last test killed serves again
        wait_until(lambda s=server: httpx.get(s.url + "/ready").status_code == 200, 60, 0.1)
    with ReplicaPool([s.url for s in shared_store], health_interval=0.5) as pool:
        client = openai_sdk(pool, key)
        whole = client.responses.create(**GREEDY)
        victim: list[str] = []
        events = streamed(client, lambda: victim.append(kill_busy(pool, shared_store)))
        assert pool.stats()[victim[0]]["resumes"] == 1
        response_id = check_one_stream(events, whole)
        survivor = next(s.url for s in shared_store if s.url != victim[0])
        assert pool.pins.where(response_id) == survivor
        kept = client.responses.retrieve(response_id)
        assert (kept.id, kept.status, kept.output_text) == (
            response_id,
            whole.status,
            whole.output_text,
        )
        turn = {"model": MODEL_NAME, "max_output_tokens": 4, "input": "And then?"}
        follow = client.responses.create(**turn, previous_response_id=response_id)
        assert follow.status in ("completed", "incomplete")
        seen = client.responses.input_items.list(follow.id).data
        assert kept.output[0].id in {item.id for item in seen}  # type: ignore[union-attr]
    # The id of a kept response is not a continuation's to take.
    taken = {**GREEDY, "continue_token_ids": [], "continue_response_id": response_id}
    refused = httpx.post(
        survivor + "/v1/responses", json=taken, headers={"authorization": f"Bearer {key}"}
    )
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "continue_response_id"


def test_a_response_cut_before_its_first_token_starts_over_under_the_callers_id(
    shared_store: list[LiveServer], key: str
) -> None:
    server = next(s for s in shared_store if s.process and s.process.poll() is None)
    marker = b"event: response.output_item.added"  # after response.created, before any token
    with (
        cutting_proxy(server.port, marker) as cut,
        ReplicaPool([cut, server.url], health_interval=0.5) as pool,
    ):
        client = openai_sdk(pool, key)
        asked = {**GREEDY, "input": question_for(pool, cut), "max_output_tokens": 8}
        events = list(client.responses.create(**asked, stream=True))
        assert pool.stats()[cut]["resumes"] == 1
        first, final = events[0].response, events[-1].response  # type: ignore[union-attr]
        assert final.id == first.id and final.output_text != ""
        assert [e.sequence_number for e in events] == list(range(len(events)))
        kept = client.responses.retrieve(first.id)
        assert (kept.status, kept.output_text) == (final.status, final.output_text)


def test_a_thread_turn_started_over_is_the_callers_under_its_kept_id(
    shared_store: list[LiveServer], key: str
) -> None:
    server = next(s for s in shared_store if s.process and s.process.poll() is None)
    marker = b"event: content_block_delta"  # after message_start, before any text
    with (
        cutting_proxy(server.port, marker) as cut,
        ReplicaPool([cut, server.url], health_interval=0.5) as pool,
    ):
        client = anthropic.Anthropic(
            base_url="http://zerohop", api_key=key, max_retries=0,
            http_client=http_client(pool=pool),
        )  # fmt: skip
        turn: Any = {"model": MODEL_NAME, "betas": [BETA]}
        question = [{"role": "user", "content": question_for(pool, cut)}]
        with client.beta.messages.stream(
            **turn, max_tokens=64, messages=question, thread={"type": "create"}
        ) as stream:
            starts = [e.message.id for e in stream if e.type == "message_start"]
            first = stream.get_final_message()
        assert starts == [first.id] and first.content
        stats = pool.stats()
        assert stats[cut]["requests"] == 1 and stats[server.url]["requests"] == 1, stats
        assert pool.pins.where(first.id) == server.url
        again = [{"role": "user", "content": "And then?"}]
        follow = client.beta.messages.create(
            **turn, max_tokens=4, messages=again,
            thread={"type": "continue", "previous_message_id": first.id},
        )  # fmt: skip
        assert follow.content
