"""The core surfaces on both engines (zerohop's and vLLM's), through the official SDKs: create
and stream on Messages, Chat, Completions and Responses; forced and auto tools; structured
outputs; `n`; logprobs; stop; abort on disconnect. Greedy answers are compared with zerohop's
offline engine on the same weights, so both engines give the same tokens as transformers.
One server per engine for the module, on the built-in tiny model (`zerohop serve tiny`):
vLLM's CPU attention takes head sizes of 32 and up, which the tests' smaller models are not."""

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
from tests.live_server import MODEL_NAME, LiveServer, with_chat_template
from zerohop import LLM, SamplingParams
from zerohop.models.tiny import tiny_model_dir

CHAT = [{"role": "user", "content": "Tell me about the quick brown fox."}]
PROMPT = "The quick brown fox jumps over"
MAX = 12
# Arguments the random model finishes in a few tokens (a free string may never close).
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
# Enums, booleans and bounded numbers: the random model finishes it in a few tokens.
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "animal": {"enum": ["cat", "dog", "fox"]},
        "ok": {"type": "boolean"},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["animal", "ok", "score"],
    "additionalProperties": False,
}


# The built-in tiny model's template, with a thought a request opts into (`enable_thinking`:
# Anthropic's `thinking`, OpenAI's `reasoning_effort`), so the surfaces' reasoning runs too.
THINK_OPT_IN = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-think") / "tiny"
    return with_chat_template(tiny_model_dir(), folder, THINK_OPT_IN)


@pytest.fixture(scope="module", params=ENGINES)
def server(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp(f"engine-{request.param}") / "server.log"
    live = serve_on(request.param, model_dir, log)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(model_dir, num_kv_blocks=256, dtype="float32")


def greedy(llm: LLM, ids: list[int], max_tokens: int = MAX) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return llm.generate(ids, params)[0].text


def same_answer(got: str, want: str) -> bool:
    """The same tokens' text: vLLM's detokenizer holds back the text of an answer that ends
    mid-character (the random model's often do) where zerohop's engine sends U+FFFD for it."""
    return got == want or (want.startswith(got) and "\ufffd" in want[len(got) :])


def oai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="any", max_retries=0)


def ant(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="any", max_retries=0)


def test_engine_is_the_one_asked_for(server: LiveServer) -> None:
    ready = httpx.get(server.url + "/ready").json()
    stats = httpx.get(server.url + "/engine/stats").json()
    assert stats["max_num_seqs"] > 0 and stats["num_blocks"] > 0
    engine = "vllm" if "--engine" in server.extra_args else "zerohop"
    assert ready.get("engine", "zerohop") == engine


def test_chat_create_and_stream(server: LiveServer, llm: LLM) -> None:
    want = greedy(llm, llm.tokenizer.encode_chat(CHAT))
    kw = dict(model=MODEL_NAME, messages=CHAT, max_tokens=MAX, temperature=0)
    got = oai(server).chat.completions.create(**kw)
    assert same_answer(got.choices[0].message.content, want)
    assert got.usage.completion_tokens == MAX and got.choices[0].finish_reason == "length"
    chunks = list(oai(server).chat.completions.create(**kw, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == got.choices[0].message.content


def test_completions_with_logprobs(server: LiveServer, llm: LLM) -> None:
    want = greedy(llm, llm.tokenizer.encode(PROMPT))
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX, temperature=0, logprobs=2)
    got = oai(server).completions.create(**kw)
    choice = got.choices[0]
    assert same_answer(choice.text, want)
    assert len(choice.logprobs.tokens) == MAX and len(choice.logprobs.token_logprobs) == MAX
    # Keyed by text: two byte tokens that both print U+FFFD share an entry.
    assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    streamed = "".join(c.choices[0].text for c in oai(server).completions.create(**kw, stream=True))
    assert streamed == choice.text


def test_messages_create_and_stream(server: LiveServer, llm: LLM) -> None:
    want = greedy(llm, llm.tokenizer.encode_chat(CHAT))
    zero = {"temperature": 0.0}  # not a parameter of this SDK version any more
    kw = dict(model=MODEL_NAME, messages=CHAT, max_tokens=MAX, extra_body=zero)
    message = ant(server).messages.create(**kw)
    assert same_answer(message.content[0].text, want) and message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == MAX
    with ant(server).messages.stream(**kw) as stream:
        assert "".join(stream.text_stream) == message.content[0].text


def test_responses_create_and_stream(server: LiveServer, llm: LLM) -> None:
    want = greedy(llm, llm.tokenizer.encode_chat(CHAT), 16)
    kw = dict(model=MODEL_NAME, input=CHAT, max_output_tokens=16, temperature=0)
    response = oai(server).responses.create(**kw)
    assert same_answer(response.output_text, want) and response.status == "incomplete"
    events = list(oai(server).responses.create(**kw, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text and events[-1].type == "response.incomplete"


def test_stop_and_n(server: LiveServer) -> None:
    kw = dict(model=MODEL_NAME, messages=CHAT, max_tokens=MAX, temperature=0)
    full = oai(server).chat.completions.create(**kw).choices[0].message.content
    stop = full[len(full) // 2 :][:2]
    cut = oai(server).chat.completions.create(**kw, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full[: full.index(stop)]
    many = oai(server).chat.completions.create(**dict(kw, temperature=1.0, seed=3, n=3))
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("length", "stop") for c in many.choices)
    # Every choice's tokens, counted once: MAX each for those cut at the length.
    cut = sum(c.finish_reason == "length" for c in many.choices)
    assert cut * MAX + (3 - cut) <= many.usage.completion_tokens <= 3 * MAX


def test_forced_and_auto_tools(server: LiveServer) -> None:
    kw = dict(model=MODEL_NAME, messages=CHAT, max_tokens=200, tools=[WEATHER])
    forced = {"type": "function", "function": {"name": "get_weather"}}
    got = oai(server).chat.completions.create(**kw, tool_choice=forced)
    calls = got.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    required = oai(server).chat.completions.create(**kw, tool_choice="required")
    assert required.choices[0].message.tool_calls
    auto = oai(server).chat.completions.create(**kw, tool_choice="auto")
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    message = ant(server).messages.create(
        model=MODEL_NAME,
        max_tokens=200,
        messages=CHAT,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    use = next(b for b in message.content if b.type == "tool_use")
    jsonschema.validate(use.input, WEATHER["function"]["parameters"])


def test_structured_outputs(server: LiveServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": ANSWER_SCHEMA}}
    got = oai(server).chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=80, response_format=fmt, temperature=0
    )
    jsonschema.validate(json.loads(got.choices[0].message.content), ANSWER_SCHEMA)
    regex = oai(server).completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=8,
        extra_body={"structured_outputs": {"regex": "[a-c]{3}x"}},
    )
    assert regex.choices[0].text.startswith(tuple("abc")) and regex.choices[0].text.endswith("x")


def test_abort_on_disconnect_frees_the_kv_cache(server: LiveServer) -> None:
    async def leave_early() -> None:
        body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 2000, "stream": True}
        body |= {"temperature": 0, "ignore_eos": True}
        async with (
            httpx.AsyncClient(base_url=server.url) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    return  # the first token came: hang up

    asyncio.run(leave_early())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = httpx.get(server.url + "/engine/stats").json()
        if stats["num_running"] == 0 and stats["blocks_in_use"] == 0:
            return
        time.sleep(0.2)
    pytest.fail(f"the request still holds the engine: {stats}")


def test_thinking(server: LiveServer) -> None:
    """A thought without a budget on both engines; a budget needs `<think>` as a token on
    vLLM's (this tokenizer spells it in pieces): refused there, naming the engine."""
    kw = dict(model=MODEL_NAME, max_tokens=24, messages=CHAT, thinking={"type": "adaptive"})
    message = ant(server).messages.create(**kw)
    assert message.content[0].type == "thinking"
    assert message.content[0].thinking and message.content[0].signature
    with ant(server).messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].signature
    budget = dict(kw, max_tokens=1040, thinking={"type": "enabled", "budget_tokens": 1024})
    budget["stop_sequences"] = ["e"]
    if "--engine" not in server.extra_args:
        assert ant(server).messages.create(**budget).content[0].type == "thinking"
        return
    with pytest.raises(anthropic.BadRequestError) as info:
        ant(server).messages.create(**budget)
    assert "vLLM engine" in info.value.message
