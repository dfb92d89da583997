"""Message threads through zerohop.client with per-replica thread stores (SQLite each): a
thread's turn is never resumed mid-stream on another replica (it could not be: the other
replica has not the thread, and a resumed turn would be stored under its own message id).
The replica answering a thread's continue is killed after the caller has text; the caller's
SDK gets the API's own error event, and the other replica is sent nothing. The continue's
prefix affinity prefers that other replica: the client sends it to the victim only because
the thread lives there (`zerohop.client.pinning`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anthropic
import pytest

from tests.live_server import MODEL_NAME, started_together
from tests.test_client_pinning import question_for
from zerohop.client import ReplicaPool, async_http_client

BETA = "message-threads-2026-08-12"
STEP_DELAY = "0.05"  # 64 tokens last about 3 s: the kill lands mid-answer


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_a_thread_turn_is_not_resumed_on_another_replica(
    llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    specs = {f"t{i}": ["--debug-step-delay", STEP_DELAY] for i in range(2)}
    with started_together(llama_dir, specs, tmp_path_factory) as servers:
        by_url = {s.url: s for s in servers.values()}
        pool = ReplicaPool(list(by_url), health_interval=0.5)
        try:
            outcome = asyncio.run(_continue_and_kill(pool, by_url))
            stats = pool.stats()
        finally:
            pool.close()
    victim, error, pieces = outcome
    assert pieces, "the caller had text before the kill"
    assert isinstance(error, anthropic.APIStatusError), error
    assert error.body["error"]["type"] == "overloaded_error", error.body  # type: ignore[index]
    other = next(url for url in by_url if url != victim)
    assert stats[other]["requests"] == 0, stats  # no resume, no restart there
    assert stats[victim]["resumes"] == 0, stats


async def _continue_and_kill(
    pool: ReplicaPool, by_url: dict
) -> tuple[str, BaseException | None, list[str]]:
    client = anthropic.AsyncAnthropic(
        base_url="http://zerohop", api_key="unused", max_retries=0,
        http_client=async_http_client(pool=pool),
    )  # fmt: skip
    first = await client.beta.messages.create(
        model=MODEL_NAME, max_tokens=2, messages=_user("hi"),  # type: ignore[arg-type]
        thread={"type": "create"}, betas=[BETA],
    )  # fmt: skip
    victim = next(url for url, r in pool.replicas.items() if r.stats.requests)
    pool.replicas[victim].stats.requests = 0  # count only the continue's requests from here
    question = question_for(pool, next(url for url in by_url if url != victim))
    pieces: list[str] = []
    error: BaseException | None = None
    try:
        async with client.beta.messages.stream(
            model=MODEL_NAME, max_tokens=64, messages=_user(question),  # type: ignore[arg-type]
            thread={"type": "continue", "previous_message_id": first.id},
            betas=[BETA],
        ) as stream:  # fmt: skip
            async for text in stream.text_stream:
                pieces.append(text)
                if len(pieces) == 1:
                    by_url[victim].process.kill()
    except anthropic.APIError as exc:
        error = exc
    await client.close()
    return victim, error, pieces
