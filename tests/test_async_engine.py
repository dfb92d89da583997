"""The engine in its own process, driven through `AsyncEngine` as the server drives it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from zerohop import LLM, SamplingParams
from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.process.async_engine import AsyncEngine, EngineDeadError

OPTIONS = {"num_kv_blocks": 64, "num_threads": 1, "max_num_batched_tokens": 64}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [list(range(5, 5 + n)) for n in (4, 19, 33, 70)]


async def _collect(engine: AsyncEngine, request_id: str, prompt: list[int], params) -> list:
    return [d async for d in engine.generate(request_id, prompt, params)]


def test_streams_match_offline_generate(llama_dir: Path) -> None:
    expected = [o.token_ids for o in LLM(llama_dir, **OPTIONS).generate(PROMPTS, GREEDY)]

    async def run() -> list[list]:
        engine = await AsyncEngine.start(str(llama_dir), **OPTIONS)
        try:
            jobs = [_collect(engine, f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
            return await asyncio.gather(*jobs)
        finally:
            await engine.shutdown()

    streams = asyncio.run(run())
    for deltas, want in zip(streams, expected, strict=True):
        assert [t for d in deltas for t in d.new_token_ids] == want
        assert all(len(d.new_token_ids) <= 1 for d in deltas), "one delta per token"
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"
        assert deltas[-1].num_prompt_tokens > 0


async def _stats_after_next_step(engine: AsyncEngine) -> dict:
    """An abort takes effect at the engine's next step: wait for it (bounded)."""
    for _ in range(100):
        stats = await engine.stats()
        if stats["num_running"] == 0:
            return stats
        await asyncio.sleep(0.02)
    return stats


def test_leaving_a_stream_aborts_and_frees_blocks(llama_dir: Path) -> None:
    async def run() -> tuple[dict, dict, list]:
        engine = await AsyncEngine.start(str(llama_dir), **OPTIONS)
        try:
            long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
            stream = engine.generate("long", PROMPTS[2], long)
            await anext(stream)
            during = await engine.stats()
            await stream.aclose()  # what a disconnecting client's handler does
            after = await _stats_after_next_step(engine)
            # The engine keeps serving others afterwards.
            other = await _collect(engine, "next", PROMPTS[0], GREEDY)
            return during, after, other
        finally:
            await engine.shutdown()

    during, after, other = asyncio.run(run())
    assert during["blocks_in_use"] > 0
    assert after["blocks_in_use"] == 0 and after["num_running"] == 0
    assert other[-1].finish_reason == "length"


def test_rejected_request_raises_and_engine_goes_on(llama_dir: Path) -> None:
    async def run() -> list:
        engine = await AsyncEngine.start(str(llama_dir), **OPTIONS)
        try:
            with pytest.raises(InvalidRequestError, match="token ids must be in"):
                await _collect(engine, "bad", [10**6], GREEDY)
            with pytest.raises(InvalidRequestError, match="context"):
                await _collect(engine, "too-long", [5] * 5000, GREEDY)
            return await _collect(engine, "good", PROMPTS[0], GREEDY)
        finally:
            await engine.shutdown()

    assert asyncio.run(run())[-1].finished


def test_engine_process_death_fails_streams_clearly(llama_dir: Path) -> None:
    async def run() -> None:
        engine = await AsyncEngine.start(str(llama_dir), **OPTIONS)
        try:
            long = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
            stream = engine.generate("doomed", PROMPTS[1], long)
            await anext(stream)
            engine._process.kill()
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            with pytest.raises(EngineDeadError):
                await engine.stats()
        finally:
            await engine.shutdown()

    asyncio.run(run())
