"""Mid-conversation system messages keep their place (conversation/system_turns.py): a
10-turn Claude-Code-shaped session (a tool call, its result with a `<system-reminder>` block,
then a system message) through each surface's mapping renders each turn's prompt as a prefix
of the next one's, on SmolLM2's own template and on synthetic ones that take a system turn
anywhere, only first (a later one raises, or is dropped), or not at all. One live session
through the anthropic SDK reads the prefix cache's hits turn by turn.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import msgspec
import pytest

from tests.live_server import MODEL_NAME, LiveServer, with_chat_template
from zerohop.api.anthropic.schema import decode_messages
from zerohop.api.anthropic.turns import conversation as messages_conversation
from zerohop.api.conversation.planner import prompt_ids
from zerohop.api.conversation.system_turns import system_support
from zerohop.api.openai.schema import ChatRequest, decode
from zerohop.api.openai.turns import conversation as chat_conversation
from zerohop.api.responses.schema import decode_request
from zerohop.api.responses.surface import ResponsesSurface
from zerohop.api.serving.service import ServingContext
from zerohop.engine.loading.gguf_file import GGUFFile
from zerohop.engine.loading.gguf_tokenizer import tokenizer_from_gguf
from zerohop.engine.text.tokenizer import Tokenizer
from zerohop.gateway.gateway import Call
from zerohop.models.default import default_model_path
from zerohop.models.toy_tokenizer import CHAT_TEMPLATE, save_tokenizer

TURNS = 10
SYSTEM = "You are an agent for software engineering."
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}
# Only a leading system turn; a later one raises (as Mistral's and Llama-2-style templates do).
FIRST_ONLY = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ '[SYS]' + messages[0]['content'] + '[/SYS]' }}{% set rest = messages[1:] %}"
    "{% else %}{% set rest = messages %}{% endif %}{% for m in rest %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('system messages must come first') }}"
    "{% elif m['role'] == 'user' %}{{ '[INST]' + m['content'] + '[/INST]' }}"
    "{% else %}{{ m['content'] + '</s>' }}{% endif %}{% endfor %}"
)
# A later system turn is silently left out (the template reads only messages[0] as system).
DROPS_LATE = FIRST_ONLY.replace("{{ raise_exception('system messages must come first') }}", "")
# No system role at all (Gemma's): any system message raises.
NO_SYSTEM = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n'"
    " + m['content'] + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
TEMPLATES = {"chatml": CHAT_TEMPLATE, "first-only": FIRST_ONLY, "drops-late": DROPS_LATE,
             "no-system": NO_SYSTEM}  # fmt: skip
SUPPORT = {"smollm2": "anywhere", "chatml": "anywhere", "first-only": "first",
           "drops-late": "first", "no-system": "none"}  # fmt: skip


def reminder(k: int) -> str:
    return f"<system-reminder>todo {k}</system-reminder>"


def budget(k: int) -> str:
    return f"<total_tokens>{900 + k}</total_tokens>"


# -- the session on each surface's wire shape --------------------------------------------------


def anthropic_messages(turn: int) -> list[dict[str, Any]]:
    """Turn `turn` of the session: the first ask, then per earlier turn a Read call, its
    result with a reminder block (Claude Code's shape) and a system message."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    for k in range(1, turn):
        call = {"type": "tool_use", "id": f"toolu_{k}", "name": "Read",
                "input": {"path": f"f{k}"}}  # fmt: skip
        result = {"type": "tool_result", "tool_use_id": f"toolu_{k}", "content": f"body {k}"}
        messages += [
            {"role": "assistant", "content": [{"type": "text", "text": f"Reading {k}."}, call]},
            {"role": "user", "content": [result, {"type": "text", "text": reminder(k)}]},
            {"role": "system", "content": budget(k)},
        ]
    return messages


def anthropic_body(turn: int) -> dict[str, Any]:
    tool = {"name": "Read", "description": "Read a file", "input_schema": SCHEMA}
    return {"model": MODEL_NAME, "max_tokens": 2, "system": SYSTEM, "tools": [tool],
            "messages": anthropic_messages(turn)}  # fmt: skip


def through_messages(ctx: ServingContext, turn: int) -> list[int]:
    request = decode_messages(msgspec.json.encode(anthropic_body(turn)))
    return prompt_ids(messages_conversation(request, ctx.tokenizer.chat_template), ctx)


def through_chat(ctx: ServingContext, turn: int) -> list[int]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Fix the failing test."},
    ]
    for k in range(1, turn):
        function = {"name": "Read", "arguments": json.dumps({"path": f"f{k}"})}
        call = {"id": f"call_{k}", "type": "function", "function": function}
        messages += [
            {"role": "assistant", "content": f"Reading {k}.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{k}", "content": f"body {k}"},
            {"role": "developer", "content": budget(k)},
        ]
    function = {"name": "Read", "description": "Read a file", "parameters": SCHEMA}
    body = {"model": MODEL_NAME, "messages": messages,
            "tools": [{"type": "function", "function": function}]}  # fmt: skip
    return prompt_ids(chat_conversation(decode(json.dumps(body).encode(), ChatRequest), {}), ctx)


def through_responses(ctx: ServingContext, turn: int) -> list[int]:
    items: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    for k in range(1, turn):
        text = [{"type": "output_text", "text": f"Reading {k}."}]
        items += [
            {"role": "assistant", "content": text},
            {"type": "function_call", "call_id": f"call_{k}", "name": "Read",
             "arguments": json.dumps({"path": f"f{k}"})},
            {"type": "function_call_output", "call_id": f"call_{k}", "output": f"body {k}"},
            {"role": "system", "content": budget(k)},
        ]  # fmt: skip
    tool = {"type": "function", "name": "Read", "description": "Read a file", "parameters": SCHEMA}
    body = {"model": MODEL_NAME, "instructions": SYSTEM, "input": items, "tools": [tool]}
    prepared = asyncio.run(ResponsesSurface(ctx)._prepare(decode_request(json.dumps(body).encode()),
                                                          Call("req_1", "openai")))  # fmt: skip
    return prepared.planned.prompt


SURFACES: dict[str, Callable[[ServingContext, int], list[int]]] = {
    "messages": through_messages, "chat": through_chat, "responses": through_responses,
}  # fmt: skip


# -- rendering ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def contexts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ServingContext]:
    """A serving context per template: SmolLM2's GGUF tokenizer, and the toy tokenizer with
    each synthetic template."""
    smollm2 = tokenizer_from_gguf(GGUFFile(default_model_path()))
    toy = tmp_path_factory.mktemp("toy-tokenizer")
    save_tokenizer(toy)
    found = {"smollm2": smollm2}
    for name, template in TEMPLATES.items():
        folder = tmp_path_factory.mktemp(name)
        for part in toy.iterdir():
            shutil.copy(part, folder / part.name)
        (folder / "chat_template.jinja").write_text(template)
        found[name] = Tokenizer.from_dir(folder)
    return {name: ServingContext(None, t, MODEL_NAME, 8192) for name, t in found.items()}  # type: ignore[arg-type]


@pytest.mark.parametrize("surface", list(SURFACES))
@pytest.mark.parametrize("template", list(SUPPORT))
def test_each_turns_prompt_is_a_prefix_of_the_next(
    contexts: dict[str, ServingContext], template: str, surface: str
) -> None:
    ctx = contexts[template]
    assert system_support(ctx.tokenizer) == SUPPORT[template]
    prompts = [SURFACES[surface](ctx, turn) for turn in range(1, TURNS + 1)]
    for turn, (this, after) in enumerate(itertools.pairwise(prompts), start=1):
        assert after[: len(this)] == this, f"turn {turn}'s prompt is not a prefix of the next"
    text = ctx.tokenizer.decode(prompts[-1], skip_special_tokens=False)
    assert text.index(SYSTEM) < text.index("Fix the failing test.")  # the leading one: first
    for k in range(1, TURNS):
        # each system message right after its turn's tool result, before the next call
        after = text.index(f"Reading {k + 1}") if k + 1 < TURNS else len(text)
        assert text.index(f"body {k}") < text.index(budget(k)) < after
        if surface == "messages":
            assert text.index(f"body {k}") < text.index(reminder(k)) < text.index(budget(k))
    wrapped = f"<system-reminder>\n{budget(1)}\n</system-reminder>"
    assert (wrapped in text) == (SUPPORT[template] != "anywhere")


# -- live: the prefix cache turn by turn --------------------------------------------------------


@pytest.fixture(scope="module")
def first_only_server(
    llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """The tiny model with a template that takes a leading system turn only, and a context
    of 4096 (the toy tokenizer spends a token on about each character of the session)."""
    folder = with_chat_template(llama_dir, tmp_path_factory.mktemp("first") / "m", FIRST_ONLY)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (folder / "config.json").write_text(json.dumps(config))
    server = LiveServer(folder).start(tmp_path_factory.mktemp("first-log") / "server.log")
    yield server
    server.stop()


def test_a_claude_code_session_hits_the_prefix_cache_every_turn(
    first_only_server: LiveServer,
) -> None:
    client = anthropic.Anthropic(base_url=first_only_server.url, api_key="any", max_retries=0)
    block = 16  # serve's default --block-size
    before = 0
    for turn in range(1, TURNS + 1):
        message = client.messages.create(**anthropic_body(turn))
        usage = message.usage
        cached = usage.cache_read_input_tokens or 0
        prompt = usage.input_tokens + cached
        print(f"turn {turn}: {cached}/{prompt} prompt tokens cached ({cached / prompt:.0%})")
        if turn > 1:
            assert cached >= before - block, f"turn {turn}: {cached} cached of {before} sent"
        assert prompt > before
        before = prompt
