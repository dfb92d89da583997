"""The OpenAI Agents SDK, unchanged, over its Responses websocket transport
(`responses_websocket_session`: OpenAIResponsesWSModel, one socket on `/v1/responses` shared
by the session's runs) against the session's live server: an Agent with a function tool,
`Runner.run` and `Runner.run_streamed` (chained by `auto_previous_response_id`), the tool
called with arguments that validate and both runs finished; the server answered them over
the socket (`zerohop_websocket_responses` in `/metrics` grew by the model calls made).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import pytest

from tests.live_server import MODEL_NAME, LiveServer

pytestmark = pytest.mark.server


@pytest.fixture
def no_tracing() -> Iterator[None]:
    """The Agents SDK's tracing off (it would export to OpenAI's servers)."""
    from agents import set_tracing_disabled

    set_tracing_disabled(True)
    yield
    set_tracing_disabled(False)


def socket_responses(server: LiveServer) -> float:
    """`zerohop_websocket_responses` from the server's /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("zerohop_websocket_responses_total "):
            return float(line.split()[1])
    raise AssertionError("no zerohop_websocket_responses_total in /metrics")


def weather_agent(calls: list[dict[str, str]], **options: Any) -> Any:
    """An Agent whose first turn must call its tool (arguments of closed sets: a random
    model's free string never ends); `calls` records the tool's calls."""
    from agents import Agent, ModelSettings, function_tool

    @function_tool
    def temperature(city: Literal["Oslo", "Rome"], unit: Literal["C", "F"]) -> str:
        """The temperature of a city."""
        calls.append({"city": city, "unit": unit})
        return "20"

    settings = ModelSettings(max_tokens=200, temperature=0, tool_choice="required")
    return Agent(
        name="weather", model=MODEL_NAME, tools=[temperature], model_settings=settings, **options
    )


@pytest.mark.usefixtures("no_tracing")
def test_agents_sdk_runs_a_tool_over_the_websocket(live_server: LiveServer) -> None:
    before = socket_responses(live_server)
    made = asyncio.run(_runs(live_server))
    assert socket_responses(live_server) - before == made


async def _runs(server: LiveServer) -> int:
    """Runner.run and Runner.run_streamed over one websocket session; the model calls made."""
    from agents import responses_websocket_session

    calls: list[dict[str, str]] = []
    async with responses_websocket_session(api_key="any", base_url=server.url + "/v1") as ws:
        # One turn: the forced call, whose result is the run's output.
        built = weather_agent(calls, tool_use_behavior="stop_on_first_tool")
        result = await ws.run(built, "Weather in Oslo?", max_turns=2)
        assert result.final_output == "20" and calls, result.new_items
        assert [i.type for i in result.new_items][:2] == ["tool_call_item", "tool_call_output_item"]
        first = len(result.raw_responses)

        # Streamed, two turns (the model run again after the tool, still forced: a random
        # model's free text would run to the token limit), the second chained to the first
        # by previous_response_id on the same socket; the second round of calls ends the run.
        called = len(calls)
        built = weather_agent(calls, tool_use_behavior=on_round(2), reset_tool_choice=False)
        streamed = ws.run_streamed(
            built, "And in Rome?", max_turns=2, auto_previous_response_id=True
        )
        kinds = {event.type async for event in streamed.stream_events()}
        assert streamed.is_complete and streamed.final_output == "20", streamed.new_items
        assert {"raw_response_event", "run_item_stream_event"} <= kinds
        assert len(calls) >= called + 2
        turns = streamed.raw_responses
        assert len(turns) == 2 and all(r.response_id for r in turns), turns
    for call in calls:
        assert call["city"] in ("Oslo", "Rome") and call["unit"] in ("C", "F"), json.dumps(calls)
    return first + len(turns)


def on_round(rounds: int) -> Any:
    """A tool_use_behavior: the tool's output is the run's, after `rounds` rounds of calls
    (until then the model runs again)."""
    from agents import ToolsToFinalOutputResult

    seen: list[int] = []

    def behavior(context: Any, results: list[Any]) -> Any:
        seen.append(len(results))
        return ToolsToFinalOutputResult(len(seen) >= rounds, results[0].output)

    return behavior
