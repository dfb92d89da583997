"""The default model (SmolLM2-135M-Instruct, a Q4_1 GGUF) on vLLM's engine: exported once to
a Hugging Face folder, served with no MODEL argument as `make run` would on a CUDA machine,
answering the README's question through both SDKs, and giving zerohop's engine's greedy
answer. Slow (the real model): `vllm_default_server` is in conftest's SLOW_FIXTURES."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.engines import serve_on
from tests.live_server import LiveServer
from zerohop.models.default import default_model_path

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
NAME = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def vllm_default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    default_model_path()  # fetched (once per machine) before the server starts
    log = tmp_path_factory.mktemp("vllm-default") / "server.log"
    server = serve_on("vllm", None, log, served_model_name=None)
    yield server
    server.stop()


def test_the_readme_question_answers_paris(vllm_default_server: LiveServer) -> None:
    url = vllm_default_server.url
    assert httpx.get(url + "/ready").json()["engine"] == "vllm"
    sdk = anthropic.Anthropic(base_url=url, api_key="any", max_retries=0)
    zero = {"temperature": 0.0}
    message = sdk.messages.create(model=NAME, max_tokens=32, messages=QUESTION, extra_body=zero)
    # zerohop's engine's answer on the GGUF (README, tests/test_default_model.py)
    assert message.content[0].text == "The capital of France is Paris."
    assert message.model == NAME and message.stop_reason == "end_turn"
    chat = openai.OpenAI(base_url=url + "/v1", api_key="any", max_retries=0)
    reply = chat.chat.completions.create(
        model=NAME, messages=QUESTION, max_tokens=32, temperature=0, logprobs=True
    )
    assert reply.choices[0].message.content == message.content[0].text
    assert reply.choices[0].logprobs.content[0].logprob <= 0


def test_tools_structured_outputs_and_responses(vllm_default_server: LiveServer) -> None:
    """The real model on vLLM's engine through the other core surfaces: a forced tool call
    whose arguments match the tool's schema, a JSON schema answer, and a streamed Responses
    answer."""
    import json

    import jsonschema

    url = vllm_default_server.url
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="any", max_retries=0)
    city = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    }
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": city}}
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    called = sdk.chat.completions.create(
        model=NAME, messages=weather, tools=[tool], tool_choice=forced, max_tokens=64
    )
    call = called.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), city)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": city}}
    answer = sdk.chat.completions.create(
        model=NAME, messages=QUESTION, response_format=fmt, max_tokens=64, temperature=0
    )
    jsonschema.validate(json.loads(answer.choices[0].message.content), city)
    events = list(
        sdk.responses.create(
            model=NAME, input=QUESTION, max_output_tokens=32, temperature=0, stream=True
        )
    )
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert "Paris" in text and events[-1].type == "response.completed"
