"""zerohop.client resumes a Responses stream: the official `openai` SDK streams through
`http_client`, the answering replica is SIGKILLed after some text deltas, and the caller
gets one valid stream (sequence numbers 0..n, one terminal event, the first replica's ids)
whose text and usage equal an uninterrupted greedy run's. A stream cut (by a proxy) once
the caller has every output token leaves nothing to continue: the client ends it with the
`response.incomplete` the replica would have sent. A streamed response that fails
mid-stream (its engine killed) is kept as `failed`, with its error.

Two replicas of the tiny llama; the engines sleep a little after each step, so a stream is
still being decoded when its replica dies.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.cutting_proxy import cutting_proxy
from tests.live_server import MODEL_NAME, LiveServer, kill_busy, started_together
from tests.test_engine_supervision import engine_pid
from zerohop.client import ReplicaPool, http_client

STEP_DELAY = "0.01"  # seconds each engine sleeps after a step
GREEDY: dict[str, Any] = {
    "model": MODEL_NAME,
    "input": "Tell me a story about a lighthouse.",
    "max_output_tokens": 48,
    "temperature": 0,
}
ENDS = ("response.completed", "response.incomplete", "response.failed")


@pytest.fixture(scope="module")
def fleet(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LiveServer]]:
    specs = {f"responses{i}": ["--debug-step-delay", STEP_DELAY] for i in range(2)}
    with started_together(llama_dir, specs, tmp_path_factory) as servers:
        yield list(servers.values())


def sdk(url: str, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, **kwargs)


def test_stream_cut_by_sigkill_resumes_as_one_stream(fleet: list[LiveServer]) -> None:
    with ReplicaPool([s.url for s in fleet], health_interval=0.5) as pool:
        client = sdk("http://zerohop", http_client=http_client(pool=pool))
        whole = client.responses.create(**GREEDY)
        events, victim = [], ""
        for event in client.responses.create(**GREEDY, stream=True):
            events.append(event)
            deltas = sum(e.type == "response.output_text.delta" for e in events)
            if deltas == 3 and not victim:
                victim = kill_busy(pool, fleet)
        assert pool.stats()[victim]["resumes"] == 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert sum(k in ENDS for k in kinds) == 1 and kinds[-1] in ENDS and kinds[-1] != ENDS[2]
    assert kinds.count("response.output_item.added") == len(whole.output) == 1
    first, final = events[0].response, events[-1].response  # type: ignore[union-attr]
    assert final.id == first.id
    item_id = final.output[0].id
    assert {e.item_id for e in events if e.type.endswith(".delta")} == {item_id}  # type: ignore[union-attr]
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert streamed == final.output_text == whole.output_text != ""
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens, "each token counted once"
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert not any("token_ids" in (e.model_extra or {}) for e in events), "not asked for"


def alive(fleet: list[LiveServer]) -> LiveServer:
    """The replica the first test left alive."""
    return fleet[1] if fleet[1].process and fleet[1].process.poll() is None else fleet[0]


def test_a_stream_cut_with_no_tokens_left_ends_incomplete(fleet: list[LiveServer]) -> None:
    server, asked = alive(fleet), {**GREEDY, "max_output_tokens": 12}
    with (
        cutting_proxy(server.port, b"event: response.incomplete") as url,
        ReplicaPool([url], health_interval=0.5) as pool,
    ):
        client = sdk("http://zerohop", http_client=http_client(pool=pool))
        events = list(client.responses.create(**asked, stream=True))
        assert pool.stats()[url]["resumes"] == 1
    direct = list(sdk(server.url).responses.create(**asked, stream=True))
    assert [e.type for e in events] == [e.type for e in direct]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final, whole = events[-1].response, direct[-1].response  # type: ignore[union-attr]
    assert final.status == "incomplete" and final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.id == events[0].response.id  # type: ignore[union-attr]
    assert final.output == [e.item for e in events if e.type == "response.output_item.done"]  # type: ignore[union-attr]
    different = {"id", "created_at", "output", "usage"}
    assert final.model_dump(exclude=different) == whole.model_dump(exclude=different)
    assert [o.model_dump(exclude={"id"}) for o in final.output] == [
        o.model_dump(exclude={"id"}) for o in whole.output
    ]
    assert final.usage is not None and whole.usage is not None
    cached = {"input_tokens_details"}  # the second run reads the prompt's prefix cache
    assert final.usage.model_dump(exclude=cached) == whole.usage.model_dump(exclude=cached)
    assert not any("usage" in (e.model_extra or {}) for e in events), "not asked for"


def test_streamed_response_failing_midstream_is_kept_failed(fleet: list[LiveServer]) -> None:
    server = alive(fleet)
    client = sdk(server.url)
    events = []
    for event in client.responses.create(**{**GREEDY, "max_output_tokens": 400}, stream=True):
        events.append(event)
        if event.type == "response.output_text.delta" and len(events) == 5:
            os.kill(engine_pid(server), signal.SIGKILL)
    assert events[-1].type == "response.failed"
    failed = events[-1].response  # type: ignore[union-attr]
    kept = client.responses.retrieve(failed.id)
    assert kept.status == "failed" and kept.error is not None
    assert kept.error.message == failed.error.message  # type: ignore[union-attr]
    assert kept.output_text == failed.output_text != ""
