"""OpenAI chat `chat_template_kwargs` (vLLM's extension), sent through the official SDK's
`extra_body` to a live server on a copy of the tiny qwen3 whose chat template reads two
kwargs: Qwen3's `enable_thinking` (false closes the thought in the generation prompt, so the
answer is content, not reasoning) and a made-up `persona` (a system line). Kwargs that are
not a JSON object, or that would replace the render's own variables, are a 400."""

from __future__ import annotations

import openai
import pytest

from tests.live_server import LiveServer, with_chat_template

MODEL = "tiny-qwen3-kwargs"
TEMPLATE = (
    "{%- if persona is defined %}"
    "{{- '<|im_start|>system\\n' + persona + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)
USER = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("kwargs") / "qwen3-kwargs"
    with_chat_template(tiny_model("qwen3"), folder, TEMPLATE)
    live = LiveServer(folder, served_model_name=MODEL)
    live.start(tmp_path_factory.mktemp("kwargs-log") / "server.log")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="any", max_retries=0)


def _chat(oai: openai.OpenAI, kwargs: object = None, **fields):
    extra = (
        {"ignore_eos": True}
        if kwargs is None
        else {"ignore_eos": True, "chat_template_kwargs": kwargs}
    )
    return oai.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=8, temperature=0, extra_body=extra, **fields
    )


def test_enable_thinking_false_answers_as_content(oai: openai.OpenAI) -> None:
    thinking = _chat(oai)
    plain = _chat(oai, {"enable_thinking": False})
    # The default prompt opens a thought the random model never closes: all reasoning.
    assert thinking.choices[0].message.reasoning_content
    assert thinking.choices[0].message.content == ""
    # enable_thinking false closes it in the prompt (more tokens): all content.
    assert plain.usage.prompt_tokens > thinking.usage.prompt_tokens
    assert plain.choices[0].message.content
    assert not getattr(plain.choices[0].message, "reasoning_content", None)


def test_a_custom_kwarg_reaches_the_template(oai: openai.OpenAI) -> None:
    base = _chat(oai).usage.prompt_tokens
    persona = _chat(oai, {"persona": "You are a pirate who answers in one line."})
    assert persona.usage.prompt_tokens > base
    streamed = list(
        _chat(oai, {"persona": "A pirate."}, stream=True, stream_options={"include_usage": True})
    )
    assert streamed[-1].usage.prompt_tokens > base
    # With tools the kwargs go to the render next to them.
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with_tools = _chat(oai, tools=tools).usage.prompt_tokens
    assert _chat(oai, {"persona": "A pirate."}, tools=tools).usage.prompt_tokens > with_tools


BAD = {
    "not an object": (
        ["enable_thinking"],
        "chat_template_kwargs",
        "Invalid value for 'chat_template_kwargs'",
    ),
    "messages": ({"messages": []}, "chat_template_kwargs.messages", "'messages' is set"),
    "tools": ({"tools": []}, "chat_template_kwargs.tools", "'tools' is set"),
    "generation prompt": (
        {"add_generation_prompt": False},
        "chat_template_kwargs.add_generation_prompt",
        "cannot be passed",
    ),
    "a special token": ({"eos_token": "x"}, "chat_template_kwargs.eos_token", "cannot be"),
}


@pytest.mark.parametrize(("kwargs", "param", "words"), BAD.values(), ids=BAD.keys())
def test_bad_kwargs_are_400(oai: openai.OpenAI, kwargs: object, param: str, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(oai, kwargs)
    assert info.value.type == "invalid_request_error" and info.value.param == param
    assert words in info.value.message
