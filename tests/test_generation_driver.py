"""The generation driver (zerohop/api/generation): what it makes of the engine's deltas, the
same for every surface. The engine plays a script (tests/scripted_engine.py) so each ending
can be produced on demand; the surfaces over a real engine are tested in their own files."""

from __future__ import annotations

import asyncio

import pytest

from tests.scripted_engine import scripted_generation
from zerohop.api.conversation.events import CallEnd, OutputReader, Text, Thought
from zerohop.api.conversation.reasoning import ReasoningParser
from zerohop.api.errors import ApiError, error_kind
from zerohop.api.generation.driver import Generation
from zerohop.api.generation.events import (
    Admitted,
    Failed,
    FinishReason,
    GenerationEvent,
    Ping,
    Step,
)
from zerohop.api.tools.hermes import HermesParser
from zerohop.engine.base.errors import EngineDeadError
from zerohop.engine.base.outputs import RequestDelta


def events_of(generation: Generation) -> list[GenerationEvent]:
    async def read() -> list[GenerationEvent]:
        return [event async for event in generation.events()]

    return asyncio.run(read())


def delta(text: str, finish: str | None = None, **fields: object) -> RequestDelta:
    return RequestDelta("r", [7], text, finished=finish is not None, finish_reason=finish,
                        **fields)  # type: ignore[arg-type]  # fmt: skip


def test_a_stream_is_admitted_then_steps_then_finishes_with_usage() -> None:
    script = [
        RequestDelta("r", admitted=True, cached_tokens=2),
        delta("Hel", cached_tokens=2),
        delta("lo", "stop", stop_reason="\n", cached_tokens=2),
    ]
    admitted, first, last = events_of(scripted_generation(None, script))
    assert isinstance(admitted, Admitted) and admitted.usage.cached_tokens == 2
    assert isinstance(first, Step) and first.output == [Text("Hel")] and first.finish is None
    assert isinstance(last, Step) and last.finish is not None
    assert last.finish.reason is FinishReason.STOP and last.finish.stop == "\n"
    usage = last.finish.usage
    assert (usage.prompt_tokens, usage.output_tokens, usage.cached_tokens) == (3, 2, 2)
    assert usage.uncached_prompt_tokens == 1


def test_a_whole_request_gets_no_admission_and_ends_at_length() -> None:
    script = [delta("a"), delta("b", "length")]
    steps = events_of(scripted_generation(None, script, stream=False))
    assert all(isinstance(s, Step) for s in steps)
    finish = steps[-1].finish  # type: ignore[union-attr]
    assert finish is not None and finish.reason is FinishReason.LENGTH and finish.truncated


def test_each_choice_is_read_and_counted_and_the_calls_end_it() -> None:
    def reader() -> OutputReader:
        return OutputReader(ReasoningParser(True), HermesParser({"add"}))

    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    script = [delta("hm</think>", index=0), delta("hi</think>ok", index=1),
              delta(call, "length", index=0), delta("!", "stop", index=1)]  # fmt: skip
    steps = events_of(scripted_generation(None, script, n=2, readers=reader, stream=False))
    assert isinstance(steps[0], Step) and steps[0].output[0] == Thought("hm")
    ends = {s.choice: s.finish for s in steps if isinstance(s, Step) and s.finish}
    assert ends[0] is not None and ends[0].reason is FinishReason.TOOL_CALLS
    assert ends[0].truncated and ends[0].thought == "hm"
    assert ends[1] is not None and ends[1].reason is FinishReason.STOP
    assert any(isinstance(e, CallEnd) for e in steps[2].output)  # type: ignore[union-attr]
    assert ends[1].usage.thought_tokens == 2  # the first step of each choice was thought


@pytest.mark.parametrize(
    ("api", "status"), [("messages", 529), ("chat", 503), ("responses", 503), ("grpc", 503)]
)
def test_a_server_abort_is_the_apis_overload_status(api: str, status: int) -> None:
    script = [RequestDelta("r", admitted=True), delta("a"), delta("", "abort")]
    *_, failed = events_of(scripted_generation(None, script, api=api))  # type: ignore[arg-type]
    assert isinstance(failed, Failed) and failed.error.status == status
    assert error_kind(failed.error) == "server_cancelled"


def test_a_failure_before_anything_was_sent_is_raised_after_it_is_an_event() -> None:
    before = scripted_generation(None, [EngineDeadError("gone")])
    with pytest.raises(ApiError) as raised:
        events_of(before)
    assert error_kind(raised.value) == "engine_dead" and raised.value.status == 503
    after = [RequestDelta("r", admitted=True), delta("x", "error", error="sampler failed")]
    *_, failed = events_of(scripted_generation(None, after))
    assert isinstance(failed, Failed) and failed.error.status == 500
    assert "sampler failed" in failed.error.message and error_kind(failed.error) == "internal"


def test_the_output_length_policy_applies_before_admission() -> None:
    generation = scripted_generation(None, [delta("a", "stop")], api="chat")
    generation.request.params.max_tokens = 4096  # past the 2048-token context: Chat refuses
    with pytest.raises(ApiError, match="max_tokens is too large"):
        events_of(generation)


def test_a_silent_stream_pings_and_a_write_postpones_the_ping() -> None:
    generation = scripted_generation(None, [RequestDelta("r", admitted=True)])
    generation.ctx.openai_ping_interval = 0.05
    engine = generation.ctx.engine

    async def slow(request_id: str, *args: object):  # type: ignore[no-untyped-def]
        yield RequestDelta("r", admitted=True)
        await asyncio.sleep(0.12)
        yield delta("a", "stop")

    engine.generate = slow  # type: ignore[method-assign]
    events = events_of(generation)
    assert isinstance(events[0], Admitted) and isinstance(events[-1], Step)
    pings = sum(isinstance(e, Ping) for e in events)
    assert 1 <= pings <= 3, events
