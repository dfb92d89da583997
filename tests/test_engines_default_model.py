"""The default model (SmolLM2-135M-Instruct, a Q4_1 GGUF) on both engines, as the Hugging Face
folder zerohop makes from the GGUF (`hf_folder_for`, what `--engine vllm` loads for the file):
the README's question through both SDKs, create and stream on Messages, Chat, Completions and
Responses, forced and auto tools, structured outputs, thinking on a reasoning template, `n`,
logprobs, stop, and abort on disconnect. Both engines run float32, so their greedy answers are
the same tokens. Slow (the real model): `default_engine_server` is in conftest's SLOW_FIXTURES.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.engines import ENGINES, serve_on
from tests.live_server import MODEL_NAME, LiveServer
from zerohop.models.default import default_model_path
from zerohop.models.hf_export import hf_folder_for

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PARIS = "The capital of France is Paris."  # zerohop's engine's answer on the GGUF (README)
ZERO = {"temperature": 0.0}  # not a parameter of the anthropic SDK any more
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
}
THINK_OPT_IN = (
    "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\\n' }}{% endif %}"
)


def thinking_template(template: str) -> str:
    """SmolLM2's own template, with a thought a request opts into after the assistant's
    opener (Anthropic's `thinking`, OpenAI's `reasoning_effort`); unchanged otherwise."""
    head, tail = template.rsplit("{% endif %}", 1)
    return head + THINK_OPT_IN + "{% endif %}" + tail


@pytest.fixture(scope="module")
def smollm2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    exported = hf_folder_for(default_model_path())
    template = json.loads((exported / "tokenizer_config.json").read_text())["chat_template"]
    folder = tmp_path_factory.mktemp("smollm2")
    for part in exported.iterdir():  # linked, not copied: the weights are 0.5 GB
        (folder / part.name).symlink_to(part)
    config = folder / "tokenizer_config.json"
    settings = json.loads(config.read_text()) | {"chat_template": thinking_template(template)}
    config.unlink()
    config.write_text(json.dumps(settings))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


@pytest.fixture(scope="module", params=ENGINES)
def default_engine_server(
    request: pytest.FixtureRequest, smollm2_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp(f"default-{request.param}") / "server.log"
    server = serve_on(request.param, smollm2_folder, log)
    yield server
    server.stop()


def oai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="any", max_retries=0)


def ant(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="any", max_retries=0)


def test_the_readme_question_answers_paris(default_engine_server: LiveServer) -> None:
    server = default_engine_server
    engine = "vllm" if "--engine" in server.extra_args else "zerohop"
    assert httpx.get(server.url + "/ready").json().get("engine", "zerohop") == engine
    kw = dict(model=MODEL_NAME, max_tokens=32, messages=QUESTION, extra_body=ZERO)
    message = ant(server).messages.create(**kw)
    assert message.content[0].text == PARIS and message.stop_reason == "end_turn"
    with ant(server).messages.stream(**kw) as stream:
        assert "".join(stream.text_stream) == PARIS
    chat = dict(model=MODEL_NAME, messages=QUESTION, max_tokens=32, temperature=0)
    reply = oai(server).chat.completions.create(**chat, logprobs=True, top_logprobs=2)
    assert reply.choices[0].message.content == PARIS
    assert reply.choices[0].finish_reason == "stop"
    tokens = reply.choices[0].logprobs.content
    assert len(tokens) == reply.usage.completion_tokens  # the end token's too
    assert all(t.logprob <= 0 and 1 <= len(t.top_logprobs) <= 2 for t in tokens)
    chunks = oai(server).chat.completions.create(**chat, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == PARIS


def test_completions_stop_n_and_logprobs(default_engine_server: LiveServer) -> None:
    server = default_engine_server
    kw = dict(model=MODEL_NAME, prompt="The capital of France is", max_tokens=12, temperature=0)
    full = oai(server).completions.create(**kw, logprobs=2).choices[0]
    assert full.text.startswith(" Paris") and full.finish_reason == "length"
    assert len(full.logprobs.token_logprobs) == 12
    assert all(lp <= 0 for lp in full.logprobs.token_logprobs)
    streamed = "".join(c.choices[0].text for c in oai(server).completions.create(**kw, stream=True))
    assert streamed == full.text
    cut = oai(server).completions.create(**kw, stop=[" Paris"]).choices[0]
    assert cut.text == "" and cut.finish_reason == "stop"
    sampled = dict(kw, temperature=1.0, seed=5, n=3, extra_body={"ignore_eos": True})
    many = oai(server).completions.create(**sampled)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in many.choices)
    assert len({c.text for c in many.choices}) > 1
    assert many.usage.completion_tokens == 3 * 12


def test_forced_and_auto_tools_and_structured_outputs(default_engine_server: LiveServer) -> None:
    sdk = oai(default_engine_server)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=MODEL_NAME, messages=weather, tools=[tool], max_tokens=64)
    call = sdk.chat.completions.create(**kw, tool_choice=forced).choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), CITY)
    auto = sdk.chat.completions.create(**kw, tool_choice="auto").choices[0]
    assert auto.finish_reason in ("stop", "length", "tool_calls")
    message = ant(default_engine_server).messages.create(
        model=MODEL_NAME,
        max_tokens=64,
        messages=weather,
        tools=[{"name": "get_weather", "input_schema": CITY}],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    use = next(b for b in message.content if b.type == "tool_use")
    assert message.stop_reason == "tool_use"
    jsonschema.validate(use.input, CITY)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": CITY}}
    answer = sdk.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, response_format=fmt, max_tokens=64, temperature=0
    )
    jsonschema.validate(json.loads(answer.choices[0].message.content), CITY)


def test_responses_create_and_stream(default_engine_server: LiveServer) -> None:
    sdk = oai(default_engine_server)
    kw = dict(model=MODEL_NAME, input=QUESTION, max_output_tokens=32, temperature=0)
    assert sdk.responses.create(**kw).output_text == PARIS
    events = list(sdk.responses.create(**kw, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == PARIS and events[-1].type == "response.completed"


def test_thinking_on_a_reasoning_template(default_engine_server: LiveServer) -> None:
    """The template opens a thought on request; SmolLM2, not trained to think, writes its
    answer inside it and ends: the answer is the thought, on Messages (created and streamed)
    and on Chat (`chat_template_kwargs`), and no text follows."""
    server = default_engine_server
    kw = dict(model=MODEL_NAME, max_tokens=32, messages=QUESTION, thinking={"type": "adaptive"})
    message = ant(server).messages.create(**kw, extra_body=ZERO)
    assert message.content[0].type == "thinking" and message.content[0].signature
    assert message.content[0].thinking == PARIS
    assert not "".join(b.text for b in message.content if b.type == "text")
    with ant(server).messages.stream(**kw, extra_body=ZERO) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == PARIS
    opt_in = {"chat_template_kwargs": {"enable_thinking": True}}  # vLLM's way, on Chat
    reply = oai(server).chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, max_tokens=32, temperature=0, extra_body=opt_in
    )
    assert reply.choices[0].message.reasoning_content == PARIS  # type: ignore[attr-defined]
    assert not reply.choices[0].message.content
    plain = ant(server).messages.create(**dict(kw, thinking={"type": "disabled"}), extra_body=ZERO)
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text == PARIS


def test_abort_on_disconnect_frees_the_kv_cache(default_engine_server: LiveServer) -> None:
    server = default_engine_server

    async def leave_early() -> None:
        body = {"model": MODEL_NAME, "messages": QUESTION, "max_tokens": 2000, "stream": True}
        body |= {"temperature": 0, "ignore_eos": True}
        async with (
            httpx.AsyncClient(base_url=server.url) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    return  # the first chunk came: hang up

    asyncio.run(leave_early())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = httpx.get(server.url + "/engine/stats").json()
        if stats["num_running"] == 0 and stats["blocks_in_use"] == 0:
            return
        time.sleep(0.2)
    pytest.fail(f"the request still holds the engine: {stats}")
