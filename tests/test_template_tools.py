"""Tools through a model's own chat template (issue 21): a copy of the tiny qwen3 served with
a Qwen2.5-style template that renders `tools` itself (no fallback preamble), and auto-mode
calls read live. The random model never writes a call of its own accord, so a regex
`structured_outputs` constraint makes it write exactly the text a model would: the
auto-mode parser must then read it as a call (or, when the arguments break the schema, give
it back as text)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.live_server import LiveServer, with_chat_template
from zerohop.api.tools.prompt import PREAMBLE
from zerohop.engine.text.tokenizer import Tokenizer

MODEL = "tiny-qwen-tools"
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object within <tool_call></tool_call> XML tags."
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and tools %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{{- message.content or '' }}{%- for call in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{- message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 3}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather.", "parameters": WEATHER},
    }
]
USER = [{"role": "user", "content": "The weather in Oslo?"}]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("tools-template") / "qwen3-tools"
    with_chat_template(tiny_model("qwen3"), folder, TEMPLATE)
    live = LiveServer(folder, served_model_name=MODEL)
    live.start(tmp_path_factory.mktemp("tools-template-log") / "server.log")
    yield live
    live.stop()


def gpt(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="any", max_retries=0)


def written(text: str) -> dict:
    """A regex constraint under which the model writes exactly `text`."""
    escaped = "".join("\\" + c if c in r"\.^$*+?()[]{}|/" else c for c in text)
    return {"structured_outputs": {"regex": escaped}}


def call_text(arguments: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'


def test_the_template_renders_the_tools(server: LiveServer) -> None:
    # Anthropic's count_tokens renders the prompt as generation does: with the tools in
    # the template's own <tools> listing (a longer prompt), never the fallback preamble.
    claude = anthropic.Anthropic(base_url=server.url, api_key="any", max_retries=0)
    tool = {"name": "get_weather", "description": "The weather.", "input_schema": WEATHER}
    plain = claude.messages.count_tokens(model=MODEL, messages=USER).input_tokens
    with_tools = claude.messages.count_tokens(model=MODEL, messages=USER, tools=[tool])
    tokenizer = Tokenizer.from_dir(server.model_dir)
    rendered = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tools=[TOOLS[0]])
    assert "# Tools" in rendered and '"name": "get_weather"' in rendered
    assert PREAMBLE.splitlines()[0] not in rendered
    assert with_tools.input_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert with_tools.input_tokens > plain


@pytest.mark.parametrize("stream", [False, True])
def test_an_auto_call_is_read_from_the_text(server: LiveServer, stream: bool) -> None:
    text = "Let me look. " + call_text('{"city": "Oslo", "days": 2}')
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=80, extra_body=written(text))
    if stream:
        with gpt(server).chat.completions.stream(**kw) as events:
            completion = events.get_final_completion()
    else:
        completion = gpt(server).chat.completions.create(**kw)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look. "
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Oslo", "days": 2}


def test_an_auto_call_the_schema_refuses_is_text(server: LiveServer) -> None:
    text = call_text('{"city": "Oslo", "days": 9}')  # days is at most 3
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=80, extra_body=written(text))
    choice = gpt(server).chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == text


def test_a_second_turn_renders_the_call_and_its_result(server: LiveServer) -> None:
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Snow, -3 C"},
    ]
    kw = dict(model=MODEL, tools=TOOLS, max_tokens=4)
    first = gpt(server).chat.completions.create(messages=USER, **kw)
    second = gpt(server).chat.completions.create(messages=history, **kw)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10
