"""Agent frameworks, unchanged, against a live server (issue 38): LangChain (ChatOpenAI and
ChatAnthropic), pydantic-ai (OpenAI chat and Anthropic models), instructor, the anthropic
SDK's tool runner and the OpenAI Agents SDK, each pointed at the server with its base URL.

Every test runs on the tiny random model (the `live_server` fixture): its outputs mean
nothing, so a test checks the protocol only. The framework's call succeeds (no 4xx/5xx);
a forced tool call or a structured output validates against the Pydantic model (the server
constrains it by grammar whenever the framework forces a tool or sends a response format or
a strict schema); and the request the framework sent is the one we expect, as recorded on
its way out of the SDKs' shared HTTP client (httpx2).

The Pydantic models have no free-text fields: a nested model and an Enum give every schema
`$defs`/`$ref`, and enums and booleans keep a random model's answer short whatever an SDK
does to the schema (the Anthropic SDK moves string limits such as maxLength into
descriptions, so a random string under its structured outputs need never end).

Cases marked xfail(strict=True) fail on the server as it is; each mark names the defect and
must go when its fix lands.
"""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import anthropic
import httpx2
import instructor
import openai
import pytest
from pydantic import BaseModel

from tests.live_server import MODEL_NAME, LiveServer

MAX_TOKENS = 300  # random whitespace between JSON tokens takes room
QUESTION = "What is the weather in Oslo?"


class Unit(enum.StrEnum):
    """An Enum argument: `$defs` in Pydantic's schema (LangChain inlines it)."""

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


class Temperature(BaseModel):
    """A tool with only an Enum argument."""

    unit: Unit


# -- what the frameworks send -------------------------------------------------------------


@dataclass
class Exchange:
    """One request a framework sent, and the status (and error body) it got back."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    status: int = 0
    error: str = ""


@dataclass
class Recorder:
    """Every request sent through httpx2 (the client every SDK here uses) in this test."""

    exchanges: list[Exchange] = field(default_factory=list)

    def request(self, request: httpx2.Request) -> Exchange:
        request.read()
        body = json.loads(request.content) if request.content else {}
        exchange = Exchange(request.url.path, dict(request.headers), body)
        self.exchanges.append(exchange)
        return exchange

    @property
    def last(self) -> Exchange:
        assert self.exchanges, "the framework sent nothing"
        return self.exchanges[-1]

    def all_ok(self) -> None:
        """Every request was answered 200: no 4xx/5xx on any of the framework's calls."""
        bad = [(x.path, x.status, x.error) for x in self.exchanges if x.status != 200]
        assert not bad, bad


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """Record what the frameworks send (sync and async httpx2 clients alike)."""
    recorder = Recorder()
    sync_send, async_send = httpx2.Client.send, httpx2.AsyncClient.send

    def send(self: httpx2.Client, request: httpx2.Request, **kwargs: Any) -> httpx2.Response:
        exchange = recorder.request(request)
        response = sync_send(self, request, **kwargs)
        exchange.status = response.status_code
        if response.status_code >= 400:
            exchange.error = response.read().decode()
        return response

    async def asend(
        self: httpx2.AsyncClient, request: httpx2.Request, **kwargs: Any
    ) -> httpx2.Response:
        exchange = recorder.request(request)
        response = await async_send(self, request, **kwargs)
        exchange.status = response.status_code
        if response.status_code >= 400:
            exchange.error = (await response.aread()).decode()
        return response

    monkeypatch.setattr(httpx2.Client, "send", send)
    monkeypatch.setattr(httpx2.AsyncClient, "send", asend)
    return recorder


def function_tool(body: dict[str, Any], name: str) -> dict[str, Any]:
    """The chat-completions tool `name` in a request body."""
    tools = {t["function"]["name"]: t["function"] for t in body.get("tools", [])}
    assert name in tools, body.get("tools")
    return tools[name]


def anthropic_tool(body: dict[str, Any], name: str) -> dict[str, Any]:
    """The Messages tool `name` in a request body."""
    tools = {t["name"]: t for t in body.get("tools", [])}
    assert name in tools, body.get("tools")
    return tools[name]


def has_defs(schema: dict[str, Any]) -> bool:
    """Whether a schema refers to `$defs` (as Pydantic writes nested models and enums)."""
    return "$defs" in schema and "$ref" in json.dumps(schema)


# -- LangChain ----------------------------------------------------------------------------


def chat_openai(server: LiveServer) -> Any:
    """langchain-openai's ChatOpenAI at the server."""
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=MODEL_NAME,
        base_url=server.url + "/v1",
        api_key="any",
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
    )


def chat_anthropic(server: LiveServer) -> Any:
    """langchain-anthropic's ChatAnthropic at the server."""
    from langchain_anthropic import ChatAnthropic

    return ChatAnthropic(
        model=MODEL_NAME,
        base_url=server.url,
        api_key="any",
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
    )


LANGCHAIN = {"ChatOpenAI": chat_openai, "ChatAnthropic": chat_anthropic}


def forced_choice(surface: str, name: str) -> dict[str, Any]:
    """The tool_choice LangChain sends to force `name` on each surface."""
    if surface == "ChatOpenAI":
        return {"type": "function", "function": {"name": name}}
    return {"type": "tool", "name": name}


def tool_parameters(surface: str, body: dict[str, Any], name: str) -> dict[str, Any]:
    """The JSON schema of tool `name` as LangChain sent it."""
    if surface == "ChatOpenAI":
        return function_tool(body, name)["parameters"]
    return anthropic_tool(body, name)["input_schema"]


@pytest.mark.parametrize("surface", LANGCHAIN)
@pytest.mark.parametrize("tool", [Temperature, Weather], ids=["enum", "nested"])
def test_langchain_bind_tools_forced(
    live_server: LiveServer, sent: Recorder, surface: str, tool: type[BaseModel]
) -> None:
    """bind_tools with a forced tool (an Enum argument; a nested model): one call whose
    arguments validate. LangChain inlines `$defs`, so the server gets a plain schema."""
    llm = LANGCHAIN[surface](live_server).bind_tools([tool], tool_choice=tool.__name__)
    message = llm.invoke(QUESTION)
    sent.all_ok()
    assert [c["name"] for c in message.tool_calls] == [tool.__name__], message
    tool.model_validate(message.tool_calls[0]["args"])
    body = sent.last.body
    assert body["tool_choice"] == forced_choice(surface, tool.__name__)
    schema = tool_parameters(surface, body, tool.__name__)
    assert "$defs" not in schema and "celsius" in json.dumps(schema)


@pytest.mark.parametrize("surface", LANGCHAIN)
def test_langchain_bind_tools_auto(live_server: LiveServer, sent: Recorder, surface: str) -> None:
    """bind_tools with both tools and no choice: the call succeeds, both tools are sent."""
    llm = LANGCHAIN[surface](live_server).bind_tools([Temperature, Weather])
    llm.invoke(QUESTION)
    sent.all_ok()
    for name in ("Temperature", "Weather"):
        tool_parameters(surface, sent.last.body, name)
    assert "tool_choice" not in sent.last.body


@pytest.mark.parametrize("surface", LANGCHAIN)
def test_langchain_stream(live_server: LiveServer, sent: Recorder, surface: str) -> None:
    """`.stream` of plain text: the chunks add up to what `.invoke` answers (greedy)."""
    llm = LANGCHAIN[surface](live_server)
    chunks = list(llm.stream(QUESTION))
    assert sent.last.body["stream"] is True
    whole = llm.invoke(QUESTION)
    sent.all_ok()
    assert len(chunks) > 1
    streamed = sum(chunks[1:], chunks[0])
    assert streamed.text == whole.text


@pytest.mark.parametrize("surface", LANGCHAIN)
def test_langchain_stream_forced_tool(
    live_server: LiveServer, sent: Recorder, surface: str
) -> None:
    """`.stream` of a forced call with a nested model: the chunks add up to a valid call."""
    llm = LANGCHAIN[surface](live_server).bind_tools([Weather], tool_choice="Weather")
    chunks = list(llm.stream(QUESTION))
    sent.all_ok()
    assert sent.last.body["stream"] is True
    message = sum(chunks[1:], chunks[0])
    assert [c["name"] for c in message.tool_calls] == ["Weather"], message
    Weather.model_validate(message.tool_calls[0]["args"])


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_openai_structured_output(
    live_server: LiveServer, sent: Recorder, method: str
) -> None:
    """ChatOpenAI.with_structured_output(nested model): a strict json_schema response format
    (with `$defs`) or a forced function; either way a valid Weather comes back."""
    llm = chat_openai(live_server).with_structured_output(Weather, method=method)
    answer = llm.invoke(QUESTION)
    sent.all_ok()
    assert isinstance(answer, Weather)
    body = sent.last.body
    if method == "json_schema":
        response_format = body["response_format"]
        assert response_format["type"] == "json_schema"
        assert response_format["json_schema"]["strict"] is True
        assert has_defs(response_format["json_schema"]["schema"])
        assert "tools" not in body
    else:
        assert body["tool_choice"] == forced_choice("ChatOpenAI", "Weather")
        assert body["parallel_tool_calls"] is False


def test_langchain_anthropic_structured_output(live_server: LiveServer, sent: Recorder) -> None:
    """ChatAnthropic.with_structured_output(nested model), its default method (a forced
    tool): a valid Weather comes back."""
    answer = chat_anthropic(live_server).with_structured_output(Weather).invoke(QUESTION)
    sent.all_ok()
    assert isinstance(answer, Weather)
    assert sent.last.body["tool_choice"] == forced_choice("ChatAnthropic", "Weather")


# -- pydantic-ai --------------------------------------------------------------------------


def pydantic_ai_model(server: LiveServer, surface: str) -> Any:
    """pydantic-ai's OpenAIChatModel or AnthropicModel, with a provider at the server. The
    Anthropic one gets the profile of a model that has structured outputs (pydantic-ai
    decides that by the model's name, which here is not Claude's)."""
    if surface == "openai":
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.providers.openai import OpenAIProvider

        provider = OpenAIProvider(base_url=server.url + "/v1", api_key="any")
        return OpenAIChatModel(MODEL_NAME, provider=provider)
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.profiles.anthropic import anthropic_model_profile
    from pydantic_ai.providers.anthropic import AnthropicProvider

    profile = anthropic_model_profile("claude-sonnet-4-5")
    provider = AnthropicProvider(base_url=server.url, api_key="any")
    return AnthropicModel(MODEL_NAME, provider=provider, profile=profile)


def pydantic_ai_agent(server: LiveServer, surface: str, output_type: Any = str) -> Any:
    """A pydantic-ai Agent on `surface` with no retries (a bad answer fails at once)."""
    from pydantic_ai import Agent
    from pydantic_ai.settings import ModelSettings

    settings = ModelSettings(max_tokens=MAX_TOKENS, temperature=0)
    model = pydantic_ai_model(server, surface)
    return Agent(model, output_type=output_type, model_settings=settings, retries=0)


PYDANTIC_AI_SURFACES = ["openai", "anthropic"]


def xfail_on(surface: str, surfaces: set[str], reason: str) -> Any:
    """`surface` as a parameter, marked xfail(strict) where it is in `surfaces`."""
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if surface in surfaces else []
    return pytest.param(surface, marks=marks)


@pytest.mark.parametrize(
    "surface",
    ["openai", "anthropic"],
)
def test_pydantic_ai_tool(live_server: LiveServer, sent: Recorder, surface: str) -> None:
    """A tool whose arguments are a nested model and an Enum, the model free to call it
    (tool_choice auto): the run succeeds. On OpenAI pydantic-ai marks the tool strict, and
    a strict schema is constrained by grammar even under auto."""
    agent = pydantic_ai_agent(live_server, surface)
    calls: list[tuple[Sky, Unit]] = []

    @agent.tool_plain
    def weather(sky: Sky, unit: Unit) -> str:
        """The weather's sky in a unit."""
        calls.append((sky, unit))
        return "sunny"

    agent.run_sync(QUESTION)
    sent.all_ok()
    first = sent.exchanges[0].body
    if surface == "openai":
        tool = function_tool(first, "weather")
        assert tool["strict"] is True and has_defs(tool["parameters"])
    else:
        assert has_defs(anthropic_tool(first, "weather")["input_schema"])


@pytest.mark.parametrize("surface", PYDANTIC_AI_SURFACES)
def test_pydantic_ai_native_output(live_server: LiveServer, sent: Recorder, surface: str) -> None:
    """NativeOutput(nested model): the provider's structured outputs (a json_schema
    response format; Anthropic's output_config.format), constrained: a valid Weather."""
    from pydantic_ai import NativeOutput

    result = pydantic_ai_agent(live_server, surface, NativeOutput(Weather)).run_sync(QUESTION)
    sent.all_ok()
    assert isinstance(result.output, Weather)
    body = sent.last.body
    if surface == "openai":
        assert body["response_format"]["type"] == "json_schema"
        assert has_defs(body["response_format"]["json_schema"]["schema"])
    else:
        assert body["output_config"]["format"]["type"] == "json_schema"
        assert has_defs(body["output_config"]["format"]["schema"])


@pytest.mark.parametrize("surface", PYDANTIC_AI_SURFACES)
def test_pydantic_ai_prompted_output(live_server: LiveServer, sent: Recorder, surface: str) -> None:
    """PromptedOutput(nested model): the schema goes in the system prompt, with a json_object
    response format on OpenAI and nothing constrained on Anthropic. Protocol only: the
    server answers 200, and on OpenAI the answer is a JSON object; whether it fits the
    schema is the model's doing (a random model's does not, and pydantic-ai says so)."""
    from pydantic_ai import PromptedOutput
    from pydantic_ai.exceptions import UnexpectedModelBehavior

    agent = pydantic_ai_agent(live_server, surface, PromptedOutput(Weather))
    try:
        result = agent.run_sync(QUESTION)
    except UnexpectedModelBehavior:  # the answer does not validate: the model's, not ours
        result = None
    sent.all_ok()
    body = sent.last.body
    if surface == "openai":
        assert body["response_format"] == {"type": "json_object"}
        assert "$defs" in body["messages"][0]["content"]
    else:
        assert "output_config" not in body and "$defs" in body["system"][0]["text"]
    if result is not None:
        assert isinstance(result.output, Weather)


@pytest.mark.parametrize(
    "surface",
    PYDANTIC_AI_SURFACES,
)
def test_pydantic_ai_tool_output(live_server: LiveServer, sent: Recorder, surface: str) -> None:
    """The default output (a nested model as pydantic-ai's `final_result` tool, forced):
    a valid Weather."""
    result = pydantic_ai_agent(live_server, surface, Weather).run_sync(QUESTION)
    sent.all_ok()
    assert isinstance(result.output, Weather)


# -- instructor ---------------------------------------------------------------------------


def instructor_client(server: LiveServer, mode: instructor.Mode) -> Any:
    """instructor around the official SDK client that `mode` belongs to."""
    if mode is instructor.Mode.ANTHROPIC_TOOLS:
        sdk = anthropic.Anthropic(base_url=server.url, api_key="any", max_retries=0)
        return instructor.from_anthropic(sdk, mode=mode)
    return instructor.from_openai(
        openai.OpenAI(base_url=server.url + "/v1", api_key="any", max_retries=0), mode=mode
    )


def instructor_create(client: Any, mode: instructor.Mode) -> Any:
    """One instructor call for a Weather, with no retries."""
    create = client.messages.create if mode is instructor.Mode.ANTHROPIC_TOOLS else None
    create = create or client.chat.completions.create
    return create(
        model=MODEL_NAME,
        response_model=Weather,
        max_retries=0,
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": QUESTION}],
    )


@pytest.mark.parametrize(
    "mode",
    [
        instructor.Mode.TOOLS,
        instructor.Mode.JSON_SCHEMA,
        instructor.Mode.ANTHROPIC_TOOLS,
    ],
    ids=lambda mode: mode.name,
)
def test_instructor(live_server: LiveServer, sent: Recorder, mode: instructor.Mode) -> None:
    """instructor's response_model (nested model) in each mode: a valid Weather. TOOLS and
    ANTHROPIC_TOOLS force a tool with `$defs`; JSON_SCHEMA sends a json_schema format."""
    answer = instructor_create(instructor_client(live_server, mode), mode)
    sent.all_ok()
    assert isinstance(answer, Weather)
    body = sent.last.body
    if mode is instructor.Mode.JSON_SCHEMA:
        assert has_defs(body["response_format"]["json_schema"]["schema"])
    elif mode is instructor.Mode.TOOLS:
        assert body["tool_choice"] == {"type": "function", "function": {"name": "Weather"}}
    else:
        assert body["tool_choice"]["type"] == "tool"


# -- the anthropic SDK's tool runner ------------------------------------------------------


def test_anthropic_tool_runner(live_server: LiveServer, sent: Recorder) -> None:
    """client.beta.messages.tool_runner with a @beta_tool taking an Enum, its defaults: the
    run ends with a message, every request answered 200."""
    from anthropic import beta_tool

    calls: list[Unit] = []

    @beta_tool
    def temperature(city: str, unit: Unit) -> str:
        """The temperature of a city.

        Args:
            city: the city.
            unit: the unit.
        """
        calls.append(Unit(unit))
        return "20"

    client = anthropic.Anthropic(base_url=live_server.url, api_key="any", max_retries=0)
    runner = client.beta.messages.tool_runner(
        model=MODEL_NAME,
        max_tokens=MAX_TOKENS,
        tools=[temperature],
        messages=[{"role": "user", "content": "The temperature in Oslo?"}],
    )
    messages = list(runner)
    sent.all_ok()
    assert messages and messages[-1].stop_reason in {"end_turn", "max_tokens"}
    assert has_defs(anthropic_tool(sent.exchanges[0].body, "temperature")["input_schema"])


def test_anthropic_tool_runner_continues_its_thread(
    live_server: LiveServer, sent: Recorder
) -> None:
    """The tool runner with the tool forced for 3 turns: the first creates the thread, each
    later one continues it with only the tool's result."""
    from anthropic import beta_tool

    calls: list[Unit] = []

    @beta_tool
    def temperature(unit: Unit) -> str:
        """The temperature in Oslo (no free string: a random model's never ends).

        Args:
            unit: the unit.
        """
        calls.append(Unit(unit))
        return "20"

    client = anthropic.Anthropic(base_url=live_server.url, api_key="any", max_retries=0)
    runner = client.beta.messages.tool_runner(
        model=MODEL_NAME,
        max_tokens=MAX_TOKENS,
        tools=[temperature],
        tool_choice={"type": "tool", "name": "temperature"},
        max_iterations=3,
        messages=[{"role": "user", "content": "The temperature in Oslo?"}],
    )
    messages = list(runner)
    sent.all_ok()
    bodies = [x.body for x in sent.exchanges]
    assert len(messages) == len(bodies) == 3 and len(calls) >= 2
    assert bodies[0]["thread"] == {"type": "create"} and "tools" in bodies[0]
    for body, previous in zip(bodies[1:], messages, strict=False):
        assert body["thread"] == {"type": "continue", "previous_message_id": previous.id}
        assert "tools" not in body  # the thread keeps them
        assert [m["content"][0]["type"] for m in body["messages"]] == ["tool_result"]


# -- the OpenAI Agents SDK ----------------------------------------------------------------


def agents_model(server: LiveServer) -> Any:
    """OpenAIChatCompletionsModel with an AsyncOpenAI client at the server."""
    from agents import OpenAIChatCompletionsModel

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="any", max_retries=0)
    return OpenAIChatCompletionsModel(model=MODEL_NAME, openai_client=client)


@pytest.fixture
def no_tracing() -> Iterator[None]:
    """The Agents SDK's tracing off (it would export to OpenAI's servers)."""
    from agents import set_tracing_disabled

    set_tracing_disabled(True)
    yield
    set_tracing_disabled(False)


def agents_run(server: LiveServer, **agent: Any) -> Any:
    """Run one Agent (a few turns at most) on the server's chat completions."""
    from agents import Agent, ModelSettings, Runner

    settings = agent.pop("model_settings", {})
    model_settings = ModelSettings(max_tokens=MAX_TOKENS, temperature=0, **settings)
    built = Agent(
        name="weather", model=agents_model(server), model_settings=model_settings, **agent
    )
    return asyncio.run(Runner.run(built, QUESTION, max_turns=3))


def enum_tool() -> Callable[..., Any]:
    """An Agents SDK function tool with an Enum argument (a strict schema with `$defs`)."""
    from agents import function_tool

    @function_tool
    def temperature(city: Literal["Oslo", "Rome"], unit: Unit) -> str:
        """The temperature of a city (no free string: a random model's never ends)."""
        return "20"

    return temperature


@pytest.mark.usefixtures("no_tracing")
def test_openai_agents_enum_tool(live_server: LiveServer, sent: Recorder) -> None:
    """An Agent with a strict Enum-argument tool (tool_choice auto): the run succeeds."""
    agents_run(live_server, tools=[enum_tool()])
    sent.all_ok()
    tool = function_tool(sent.exchanges[0].body, "temperature")
    assert tool["strict"] is True and has_defs(tool["parameters"])


@pytest.mark.usefixtures("no_tracing")
def test_openai_agents_output_type(live_server: LiveServer, sent: Recorder) -> None:
    """output_type=nested model, no tools: a strict json_schema format, a valid Weather."""
    result = agents_run(live_server, output_type=Weather)
    sent.all_ok()
    assert isinstance(result.final_output, Weather)
    assert sent.last.body["response_format"]["json_schema"]["strict"] is True


@pytest.mark.usefixtures("no_tracing")
def test_openai_agents_output_type_with_required_tool(
    live_server: LiveServer, sent: Recorder
) -> None:
    """output_type + ModelSettings(tool_choice="required") with the Enum tool: the first
    turn must call the tool (forced, with a response format), then the final output."""
    result = agents_run(
        live_server,
        tools=[enum_tool()],
        output_type=Weather,
        model_settings={"tool_choice": "required"},
    )
    sent.all_ok()
    first = sent.exchanges[0].body
    assert first["tool_choice"] == "required" and "response_format" in first
    assert isinstance(result.final_output, Weather)
