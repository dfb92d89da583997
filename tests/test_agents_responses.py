"""The OpenAI Agents SDK, unchanged, with its default model class (OpenAIResponsesModel, so
the Responses API, not chat completions) against a live server: a function tool under
tool_choice "required", a Pydantic output_type (a strict json_schema text.format),
`Runner.run_streamed` and previous_response_id chaining, within a run and across runs.

Every test runs on the tiny random model (the `live_server` fixture): its outputs mean
nothing, so a test checks the protocol only. Every request the SDK sends is answered 200;
a forced tool call's arguments and a structured output validate (the server constrains them
by grammar); and the requests are the ones we expect, as recorded on their way out of the
SDK's HTTP client (httpx2, which the openai SDK uses).

The Pydantic models have no free-text fields: a nested model and an Enum give the schemas
`$defs`/`$ref`, and enums and booleans keep a random model's answer short.
"""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx2
import openai
import pytest
from pydantic import BaseModel

from tests.live_server import MODEL_NAME, LiveServer

MAX_TOKENS = 300  # random whitespace between JSON tokens takes room
QUESTION = "What is the weather in Oslo?"
RESPONSES = "/v1/responses"


class Unit(enum.StrEnum):
    """An Enum: `$defs` in Pydantic's schema."""

    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Sky(BaseModel):
    """The nested model."""

    cloudy: bool
    windy: bool


class Weather(BaseModel):
    """The weather somewhere."""

    unit: Unit
    sky: Sky


# -- what the SDK sends -------------------------------------------------------------------


@dataclass
class Exchange:
    """One request the SDK sent, and the status (and error body) it got back."""

    method: str
    path: str
    body: dict[str, Any]
    status: int = 0
    error: str = ""
    response: dict[str, Any] = field(default_factory=dict)  # a non-streamed answer's JSON


@dataclass
class Recorder:
    """Every request sent through httpx2 (the openai SDK's HTTP client) in this test."""

    exchanges: list[Exchange] = field(default_factory=list)

    def bodies(self) -> list[dict[str, Any]]:
        """The JSON bodies of every request, in order, each checked to be a POST to
        /v1/responses (the SDK's default model uses nothing else)."""
        assert self.exchanges, "the SDK sent nothing"
        calls = [(x.method, x.path) for x in self.exchanges]
        assert calls == [("POST", RESPONSES)] * len(calls), calls
        return [x.body for x in self.exchanges]

    def responses(self) -> list[dict[str, Any]]:
        """The server's JSON answers, in order (none may be a stream)."""
        assert all(x.response for x in self.exchanges), "a streamed answer"
        return [x.response for x in self.exchanges]

    def all_ok(self) -> None:
        """Every request was answered 200: no 4xx/5xx on any of the SDK's calls."""
        bad = [(x.path, x.status, x.error) for x in self.exchanges if x.status != 200]
        assert not bad, bad


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """Record what the SDK sends through its async httpx2 client."""
    recorder = Recorder()
    async_send = httpx2.AsyncClient.send

    async def asend(
        self: httpx2.AsyncClient, request: httpx2.Request, **kwargs: Any
    ) -> httpx2.Response:
        request.read()
        body = json.loads(request.content) if request.content else {}
        exchange = Exchange(request.method, request.url.path, body)
        recorder.exchanges.append(exchange)
        response = await async_send(self, request, **kwargs)
        exchange.status = response.status_code
        if response.status_code >= 400:
            exchange.error = (await response.aread()).decode()
        elif not kwargs.get("stream"):  # read already: not a stream
            exchange.response = response.json()
        return response

    monkeypatch.setattr(httpx2.AsyncClient, "send", asend)
    return recorder


@pytest.fixture
def no_tracing() -> Iterator[None]:
    """The Agents SDK's tracing off (it would export to OpenAI's servers)."""
    from agents import set_tracing_disabled

    set_tracing_disabled(True)
    yield
    set_tracing_disabled(False)


# -- the agents ---------------------------------------------------------------------------


def agent(server: LiveServer, **options: Any) -> Any:
    """An Agent on OpenAIResponsesModel with an AsyncOpenAI client at the server."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="any", max_retries=0)
    model = OpenAIResponsesModel(model=MODEL_NAME, openai_client=client)
    settings = ModelSettings(max_tokens=MAX_TOKENS, temperature=0, **options.pop("settings", {}))
    return Agent(name="weather", model=model, model_settings=settings, **options)


def run(built: Any, question: Any = QUESTION, **options: Any) -> Any:
    """Runner.run, a few turns at most."""
    from agents import Runner

    return asyncio.run(
        Runner.run(built, question, max_turns=options.pop("max_turns", 3), **options)
    )


def temperature_tool(calls: list[tuple[str, Unit]]) -> Any:
    """A function tool with a Literal and an Enum argument (a strict schema with `$defs`),
    which records its calls."""
    from agents import function_tool

    @function_tool
    def temperature(city: Literal["Oslo", "Rome"], unit: Unit) -> str:
        """The temperature of a city (no free string: a random model's never ends)."""
        calls.append((city, Unit(unit)))
        return "20"

    return temperature


def tool(body: dict[str, Any], name: str) -> dict[str, Any]:
    """The Responses function tool `name` in a request body (flat: name, parameters)."""
    tools = {t["name"]: t for t in body.get("tools", []) if t["type"] == "function"}
    assert name in tools, body.get("tools")
    return tools[name]


def has_defs(schema: dict[str, Any]) -> bool:
    """Whether a schema refers to `$defs` (as Pydantic writes nested models and enums)."""
    return "$defs" in schema and "$ref" in json.dumps(schema)


def input_types(body: dict[str, Any]) -> list[str]:
    """The types of a request's input items (a message's role is its type here)."""
    items = body["input"]
    if isinstance(items, str):
        return ["text"]
    return [item.get("type", "message") for item in items]


# -- the tests ----------------------------------------------------------------------------


def required_tool_agent(server: LiveServer, calls: list[tuple[str, Unit]], **options: Any) -> Any:
    """An Agent with the temperature tool under tool_choice "required"."""
    settings = {"tool_choice": "required"}
    return agent(server, tools=[temperature_tool(calls)], settings=settings, **options)


def two_turns(built: Any, **options: Any) -> Any:
    """A run of two turns at most: the forced call, then the model free (reset_tool_choice).
    None where the model called the tool again (a third turn is past max_turns)."""
    from agents import MaxTurnsExceeded

    try:
        return run(built, max_turns=2, **options)
    except MaxTurnsExceeded:
        return None


def function_calls(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The function_call items of a Responses object."""
    return [item for item in response["output"] if item["type"] == "function_call"]


@pytest.mark.usefixtures("no_tracing")
def test_required_tool_stops_on_first_call(live_server: LiveServer, sent: Recorder) -> None:
    """A @function_tool under tool_choice "required", stop_on_first_tool: one request, with
    the tool strict (its `$defs` kept); one call whose arguments validate, the tool ran
    with them, and its result is the run's output."""
    calls: list[tuple[str, Unit]] = []
    built = required_tool_agent(live_server, calls, tool_use_behavior="stop_on_first_tool")
    result = run(built)
    sent.all_ok()
    [body] = sent.bodies()
    assert body["model"] == MODEL_NAME and body["tool_choice"] == "required"
    assert body["max_output_tokens"] == MAX_TOKENS and "text" not in body
    schema = tool(body, "temperature")
    assert schema["strict"] is True and has_defs(schema["parameters"])
    [response] = sent.responses()
    assert response["status"] == "completed" and response["tool_choice"] == "required"
    made = function_calls(response)
    assert made and [c["name"] for c in made] == ["temperature"] * len(made)
    assert [tuple(json.loads(c["arguments"]).values()) for c in made] == calls
    assert result.final_output == "20"
    assert [i.type for i in result.new_items][:2] == ["tool_call_item", "tool_call_output_item"]


@pytest.mark.usefixtures("no_tracing")
def test_required_tool_then_the_next_turn(live_server: LiveServer, sent: Recorder) -> None:
    """The same tool, run_llm_again (the default): the second request replays the whole
    history, the call as a function_call item (with its id and status) and the tool's
    result as a function_call_output of the same call_id, with tool_choice reset; the
    server accepts it and answers under tool_choice auto."""
    calls: list[tuple[str, Unit]] = []
    two_turns(required_tool_agent(live_server, calls))
    sent.all_ok()
    first, second = sent.bodies()
    assert first["tool_choice"] == "required" and "tool_choice" not in second
    [call] = function_calls(sent.responses()[0])
    assert second["input"][0] == first["input"][0]
    assert input_types(second) == ["message", "function_call", "function_call_output"]
    replayed, output = second["input"][1:]
    assert replayed["call_id"] == call["call_id"] and replayed["id"] == call["id"]
    assert replayed["arguments"] == call["arguments"]
    assert output == {"type": "function_call_output", "call_id": call["call_id"], "output": "20"}
    answer = sent.responses()[1]
    assert answer["status"] == "completed" and answer["tool_choice"] == "auto"
    assert len(calls) == 1 + len(function_calls(answer))


@pytest.mark.usefixtures("no_tracing")
def test_auto_previous_response_id(live_server: LiveServer, sent: Recorder) -> None:
    """auto_previous_response_id: the second turn carries the first response's id and only
    the tool's output, and the server rebuilds the same prompt from the stored response as
    from the whole history (the same input tokens, the same greedy answer)."""
    two_turns(required_tool_agent(live_server, []))  # the whole history, for comparison
    whole = sent.responses()[1]
    sent.exchanges.clear()
    two_turns(required_tool_agent(live_server, []), auto_previous_response_id=True)
    sent.all_ok()
    first, second = sent.bodies()
    answered, chained = sent.responses()
    assert "previous_response_id" not in first
    assert second["previous_response_id"] == answered["id"]
    assert chained["previous_response_id"] == answered["id"]
    [call] = function_calls(answered)
    assert second["input"] == [
        {"type": "function_call_output", "call_id": call["call_id"], "output": "20"}
    ]
    assert chained["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert chained["output"][0]["type"] == whole["output"][0]["type"]
    assert json.dumps(chained["output"][0].get("content")) == json.dumps(
        whole["output"][0].get("content")
    )


@pytest.mark.usefixtures("no_tracing")
def test_output_type(live_server: LiveServer, sent: Recorder) -> None:
    """output_type=a nested Pydantic model: the SDK sends text.format json_schema (strict,
    with `$defs`), the server constrains the answer, final_output is a Weather."""
    result = run(agent(live_server, output_type=Weather))
    sent.all_ok()
    [body] = sent.bodies()
    fmt = body["text"]["format"]
    assert fmt["type"] == "json_schema" and fmt["strict"] is True
    assert fmt["name"] == "final_output" and has_defs(fmt["schema"])
    assert "tool_choice" not in body
    [response] = sent.responses()
    assert response["text"]["format"]["type"] == "json_schema"
    assert isinstance(result.final_output, Weather)


def streamed(built: Any) -> tuple[Any, list[Any]]:
    """Runner.run_streamed to its end: the result and the raw Responses events."""
    from agents import Runner

    async def stream() -> tuple[Any, list[Any]]:
        result = Runner.run_streamed(built, QUESTION, max_turns=3)
        events = [e async for e in result.stream_events() if e.type == "raw_response_event"]
        return result, [e.data for e in events]

    return asyncio.run(stream())


def check_event_order(events: list[Any]) -> None:
    """response.created first, the terminal event last, sequence numbers 0, 1, 2, ..."""
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert types[-1] in {"response.completed", "response.incomplete"}, types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.id == events[0].response.id


@pytest.mark.usefixtures("no_tracing")
def test_run_streamed(live_server: LiveServer, sent: Recorder) -> None:
    """Runner.run_streamed with output_type: the raw events arrive in order (created ...
    text deltas ... output_text.done ... completed), the run finishes, and the streamed
    text is the final output, a Weather."""
    result, events = streamed(agent(live_server, output_type=Weather))
    sent.all_ok()
    [body] = sent.bodies()
    assert body["stream"] is True and body["text"]["format"]["type"] == "json_schema"
    check_event_order(events)
    types = [e.type for e in events]
    for kind in ("output_item.added", "content_part.added", "output_text.done", "output_item.done"):
        assert "response." + kind in types, types
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == text
    assert result.is_complete and isinstance(result.final_output, Weather)
    assert Weather.model_validate_json(text) == result.final_output
    final = events[-1].response
    assert final.status == "completed" and final.output[0].content[0].text == text


@pytest.mark.usefixtures("no_tracing")
def test_run_streamed_required_tool(live_server: LiveServer, sent: Recorder) -> None:
    """Runner.run_streamed with the required tool (stop_on_first_tool): the call streams as
    function_call_arguments deltas adding up to the .done arguments, which validate; the
    tool runs and the run finishes with its result."""
    calls: list[tuple[str, Unit]] = []
    built = required_tool_agent(live_server, calls, tool_use_behavior="stop_on_first_tool")
    result, events = streamed(built)
    sent.all_ok()
    [body] = sent.bodies()
    assert body["stream"] is True and body["tool_choice"] == "required"
    check_event_order(events)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert added and added[0].type == "function_call" and added[0].name == "temperature"
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    dones = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas and dones
    first = "".join(e.delta for e in deltas if e.item_id == dones[0].item_id)
    assert first == dones[0].arguments
    assert [tuple(json.loads(e.arguments).values()) for e in dones] == calls
    assert result.is_complete and result.final_output == "20"


@pytest.mark.usefixtures("no_tracing")
def test_previous_response_id(live_server: LiveServer, sent: Recorder) -> None:
    """Two runs chained by Runner.run(previous_response_id=...): the second request carries
    the first response's id and only the new input; the server finds the stored response
    (its prompt holds the first turn: more input tokens than the first request's)."""
    first = run(agent(live_server, output_type=Weather))
    assert first.last_response_id
    second = run(
        agent(live_server, output_type=Weather),
        "And in Rome?",
        previous_response_id=first.last_response_id,
    )
    sent.all_ok()
    bodies = sent.bodies()
    assert len(bodies) == 2 and "previous_response_id" not in bodies[0]
    answered, chained = sent.responses()
    assert answered["id"] == first.last_response_id and answered["store"] is True
    assert bodies[1]["previous_response_id"] == first.last_response_id
    assert bodies[1]["input"] == [{"content": "And in Rome?", "role": "user"}]
    assert chained["previous_response_id"] == first.last_response_id
    used = answered["usage"]
    assert chained["usage"]["input_tokens"] > used["input_tokens"] + used["output_tokens"]
    assert isinstance(second.final_output, Weather)
    assert second.last_response_id == chained["id"] != first.last_response_id
