"""Every request and block field of today's Messages API (anthropic SDK 2.16, Claude Code
2.1.x) against a live server on the tiny llama: honoured (context editing, system messages,
the billing header, the max_tokens clamp) or accepted with a documented rule, never a 400;
blocks a text-only model cannot take are a 400 naming the block."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from zerohop.api.anthropic.context import PLACEHOLDER
from zerohop.api.anthropic.schema import decode_messages
from zerohop.api.anthropic.turns import conversation
from zerohop.api.conversation.system_turns import system_support
from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.text.tokenizer import Tokenizer

CONTEXT = 2048  # the live server's max_model_len
TOOL = {
    "name": "read_file",
    "description": "Read a file.",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
}
GREP = {**TOOL, "name": "grep"}
RESULT = "line of a long file " * 20
BETA = "context-management-2025-06-27"


def client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="any", max_retries=0)


def tool_loop(names: list[str]) -> list[dict[str, Any]]:
    """A user question, then for each name an assistant call and the user's tool result."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Look at the files."}]
    for i, name in enumerate(names):
        call = {"type": "tool_use", "id": f"toolu_{i}", "name": name, "input": {"path": f"f{i}"}}
        messages.append({"role": "assistant", "content": [call]})
        result = {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": RESULT}
        messages.append({"role": "user", "content": [result]})
    return messages


def cleared(messages: list[dict[str, Any]], ids: set[str], inputs: bool = False) -> list[dict]:
    """The messages as clear_tool_uses should leave them (what the prompt is compared with)."""
    out = json.loads(json.dumps(messages))
    for message in out:
        for block in message["content"] if isinstance(message["content"], list) else []:
            if block["type"] == "tool_result" and block["tool_use_id"] in ids:
                block["content"] = PLACEHOLDER
            if inputs and block["type"] == "tool_use" and block["id"] in ids:
                block["input"] = {}
    return out


def count(server: LiveServer, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL_NAME, **fields}
    response = httpx.post(server.url + "/v1/messages/count_tokens", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def post(server: LiveServer, path: str = "/v1/messages", **fields: Any) -> httpx.Response:
    body = {"model": MODEL_NAME, "max_tokens": 2, **fields}
    return httpx.post(server.url + path, json=body, timeout=60)


def sse(response: httpx.Response) -> list[tuple[str, dict]]:
    events, name = [], ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[6:])))
    return events


# -- 1. context_management ------------------------------------------------------------------


def test_clear_tool_uses_clears_the_oldest_results(live_server: LiveServer) -> None:
    messages = tool_loop(["read_file", "grep", "read_file", "read_file"])
    edit = {
        "type": "clear_tool_uses_20250919",
        "trigger": {"type": "tool_uses", "value": 2},
        "keep": {"type": "tool_uses", "value": 1},
        "exclude_tools": ["grep"],
    }
    context = {"edits": [edit]}
    tools = [TOOL, GREP]
    counted = count(live_server, messages=messages, tools=tools, context_management=context)
    want = count(live_server, messages=cleared(messages, {"toolu_0", "toolu_2"}), tools=tools)
    plain = count(live_server, messages=messages, tools=tools)
    assert counted["input_tokens"] == want["input_tokens"] < plain["input_tokens"]
    assert counted["context_management"] == {"original_input_tokens": plain["input_tokens"]}
    # Through the SDK's beta surface (anthropic-beta header, ?beta=true).
    message = client(live_server).beta.messages.create(
        model=MODEL_NAME,
        max_tokens=2,
        messages=messages,
        tools=[TOOL, GREP],
        context_management=context,
        betas=[BETA],
    )
    applied = message.context_management.applied_edits
    assert [(e.type, e.cleared_tool_uses) for e in applied] == [("clear_tool_uses_20250919", 2)]
    assert applied[0].cleared_input_tokens == plain["input_tokens"] - want["input_tokens"]
    assert (
        message.usage.input_tokens + message.usage.cache_read_input_tokens
        == counted["input_tokens"]
    )


def test_clear_tool_uses_in_the_stream(live_server: LiveServer) -> None:
    messages = tool_loop(["read_file"] * 4)
    context = {"edits": [{"type": "clear_tool_uses_20250919", "clear_tool_inputs": True,
                          "trigger": {"type": "input_tokens", "value": 10}}]}  # fmt: skip
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": messages, "tools": [TOOL]}
    with httpx.stream(
        "POST", live_server.url + "/v1/messages?beta=true", timeout=60,
        json={**body, "stream": True, "context_management": context},
        headers={"anthropic-beta": f"{BETA},some-future-beta-2099-01-01"},
    ) as response:  # fmt: skip
        assert response.status_code == 200
        events = sse(response)
    delta = next(data for name, data in events if name == "message_delta")
    (edit,) = delta["context_management"]["applied_edits"]
    assert edit["type"] == "clear_tool_uses_20250919" and edit["cleared_tool_uses"] == 1  # keep 3
    want = count(live_server, messages=cleared(messages, {"toolu_0"}, inputs=True), tools=[TOOL])
    plain = count(live_server, messages=messages, tools=[TOOL])
    assert edit["cleared_input_tokens"] == plain["input_tokens"] - want["input_tokens"]


@pytest.mark.parametrize(
    "edit",
    [
        {"type": "clear_tool_uses_20250919"},  # default trigger: 100,000 input tokens
        {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 4}},
        {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 0},
         "clear_at_least": {"type": "input_tokens", "value": 100_000}},
        {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 0},
         "keep": {"type": "tool_uses", "value": 4}},
        {"type": "clear_thinking_20251015"},  # no thinking block to clear
    ],
)  # fmt: skip
def test_edits_that_clear_nothing_are_not_applied(live_server: LiveServer, edit: dict) -> None:
    messages = tool_loop(["read_file"] * 4)
    body = {"messages": messages, "tools": [TOOL], "context_management": {"edits": [edit]}}
    response = post(live_server, **body)
    assert response.status_code == 200, response.text
    assert response.json()["context_management"] == {"applied_edits": []}
    plain = count(live_server, messages=messages, tools=[TOOL])["input_tokens"]
    assert count(live_server, **body)["input_tokens"] == plain


def test_clear_thinking_drops_earlier_thoughts(live_server: LiveServer) -> None:
    # Thoughts this server did not sign are left out of the prompt (a 400 only with
    # --strict-thought-signatures: tests/test_thought_signatures.py), as are thoughts before
    # the last user message: dropping these frees no prompt token.
    thought = {"type": "thinking", "thinking": "hmm", "signature": "not-ours"}
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [thought, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": [thought, {"type": "text", "text": "d"}]},
        {"role": "user", "content": "e"},
    ]
    assert post(live_server, messages=messages).status_code == 200
    keep = {"type": "thinking_turns", "value": 0}
    edits = {"edits": [{"type": "clear_thinking_20251015", "keep": keep}]}
    response = post(live_server, messages=messages, context_management=edits)
    assert response.status_code == 200, response.text
    applied = response.json()["context_management"]["applied_edits"]
    assert applied == [{"type": "clear_thinking_20251015", "cleared_thinking_turns": 2,
                        "cleared_input_tokens": 0}]  # fmt: skip
    kept = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    response = post(live_server, messages=messages, context_management=kept)
    assert response.status_code == 200, response.text
    assert response.json()["context_management"] == {"applied_edits": []}


def test_compaction_under_its_trigger_is_not_applied(live_server: LiveServer) -> None:
    # Compaction itself: tests/test_compaction.py.
    edits = {"edits": [{"type": "compact_20260112"}]}
    response = post(live_server, messages=[{"role": "user", "content": "a"}],
                    context_management=edits)  # fmt: skip
    assert response.status_code == 200, response.text
    assert response.json()["context_management"] == {"applied_edits": []}


# -- 2. system messages ---------------------------------------------------------------------


def test_system_messages_are_system_turns(live_server: LiveServer, llama_dir) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "system", "content": [{"type": "text", "text": "Now answer in French."}]},
        {"role": "user", "content": "c"},
    ]
    tokenizer = Tokenizer.from_dir(llama_dir)
    want = [{"role": "system", "content": "You help.\n\nBe brief."}, *messages[1:3],
            {"role": "system", "content": "Now answer in French."}, messages[4]]  # fmt: skip
    counted = count(live_server, messages=messages, system="You help.")
    assert counted["input_tokens"] == len(tokenizer.encode_chat(want))
    response = post(live_server, messages=messages, system="You help.")
    assert response.status_code == 200, response.text
    bad = [{"role": "system", "content": [{"type": "image", "source": {}}]}, messages[1]]
    refused = post(live_server, messages=bad)
    assert refused.status_code == 400
    assert "messages.0.content.0: system content takes text blocks only" in refused.text


class _Renderer:
    def __init__(self, template: str, render) -> None:
        self.chat_template, self.render = template, render

    def apply_chat_template(self, messages, add_generation_prompt=True, **extra) -> str:
        return self.render(messages)


def _raises(messages) -> str:
    raise InvalidRequestError("chat template error: roles must alternate")


def test_system_messages_keep_their_place_whatever_the_template() -> None:
    def dropping(messages) -> str:
        return "".join(m["content"] for m in messages if m["role"] != "system")

    assert system_support(_Renderer("chatml", lambda m: json.dumps(m))) == "anywhere"
    assert system_support(_Renderer("raising", _raises)) != "anywhere"
    assert system_support(_Renderer("dropping", dropping)) != "anywhere"
    body = {
        "model": MODEL_NAME, "max_tokens": 2, "system": "S",
        "messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "T"},
                     {"role": "user", "content": "b"}],
    }  # fmt: skip
    request = decode_messages(json.dumps(body).encode())
    late = [(t.role, t.text) for t in conversation(request, None).turns]
    assert late == [("system", "S"), ("user", "a"), ("system", "T"), ("user", "b")]
    # the planner renders T at its place, as the template allows (tests/test_system_in_place.py)


# -- 3. fields accepted ---------------------------------------------------------------------

CACHE = {"type": "ephemeral", "ttl": "1h"}


def test_every_current_field_is_accepted(live_server: LiveServer) -> None:
    call = {
        "type": "tool_use",
        "id": "toolu_1",
        "name": "read_file",
        "input": {"path": "a"},
        "caller": {"type": "direct"},
        "toolset_name": None,
        "cache_control": CACHE,
    }
    server_call = {
        "type": "server_tool_use",
        "id": "srvtoolu_1",
        "name": "web_search",
        "input": {"query": "x"},
        "caller": {"type": "direct"},
        "cache_control": CACHE,
    }
    search = {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []}
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [{"type": "text", "text": "ok", "cache_control": CACHE}],
        "toolset_name": "files",
        "is_error": False,
        "cache_control": CACHE,
    }
    thought = {"type": "redacted_thinking", "data": "opaque"}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": CACHE}]},
        {"role": "assistant", "content": [thought, server_call, search, call]},
        {"role": "user", "content": [result]},
    ]
    tool = {
        **TOOL,
        "cache_control": CACHE,
        "allowed_callers": ["direct"],
        "defer_loading": False,
        "input_examples": [{"path": "a"}],
        "eager_input_streaming": True,
        "strict": False,
    }
    fields = dict(
        messages=messages, tools=[tool], tool_choice={"type": "auto"},
        system=[{"type": "text", "text": "You help.", "cache_control": CACHE}],
        cache_control=CACHE, service_tier="auto", speed="standard", inference_geo="us",
        metadata={"user_id": "user_1"}, output_config={"effort": "low"},
        container="container_1", diagnostics={"previous_message_id": "msg_1"},
        user_profile_id="prof_1", workspace_id="wrkspc_1", billing_policy=None,
        fallbacks="default", fallback_credit_token=None,
    )  # fmt: skip
    response = post(live_server, **fields)
    assert response.status_code == 200, response.text
    refused = post(live_server, messages=messages[:1], mcp_servers=[])
    assert refused.status_code == 400
    assert "mcp_servers: not supported by this server" in refused.text
    # `compaction` is decoded (tests/test_compaction.py): a value of another shape is a 400.
    refused = post(live_server, messages=messages[:1], compaction=[])
    assert refused.status_code == 400 and "compaction" in refused.text
    # `thread` is decoded (tests/test_message_threads.py): a value of another shape is a 400.
    refused = post(live_server, messages=messages[:1], thread=[])
    assert refused.status_code == 400 and "thread" in refused.text
    counted = {k: v for k, v in fields.items() if k not in ("service_tier", "inference_geo",
               "metadata", "container", "diagnostics", "billing_policy", "fallbacks",
               "fallback_credit_token")}  # fmt: skip
    assert count(live_server, **counted)["input_tokens"] > 0


# -- 4. thinking on a model without a reasoning format --------------------------------------


@pytest.mark.parametrize(
    "thinking",
    [{"type": "disabled"}, {"type": "adaptive"}, {"type": "enabled", "budget_tokens": 1024},
     {"type": "between_tools"}],
    ids=lambda t: t["type"],
)  # fmt: skip
def test_thinking_without_a_reasoning_format(live_server: LiveServer, thinking: dict) -> None:
    max_tokens = 1025 if thinking["type"] == "enabled" else 2  # more than the budget
    kw = dict(model=MODEL_NAME, max_tokens=max_tokens, messages=[{"role": "user", "content": "hi"}])
    message = client(live_server).messages.create(**kw, extra_body={"thinking": thinking,
                                                                    "temperature": 0})  # fmt: skip
    assert [b.type for b in message.content] == ["text"]
    counted = client(live_server).messages.count_tokens(
        model=MODEL_NAME, messages=kw["messages"], extra_body={"thinking": thinking}
    )
    plain = client(live_server).messages.count_tokens(model=MODEL_NAME, messages=kw["messages"])
    assert counted.input_tokens == plain.input_tokens
    small = {"type": "enabled", "budget_tokens": 100}
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens: must be >= 1024"):
        client(live_server).messages.create(**kw, extra_body={"thinking": small})


# -- 5. blocks a text-only model cannot take -------------------------------------------------


@pytest.mark.parametrize("kind", ["image", "document", "search_result"])
def test_media_blocks_are_named(live_server: LiveServer, kind: str) -> None:
    block = {"type": kind, "source": {"type": "base64", "media_type": "x/y", "data": ""}}
    content = [{"type": "text", "text": "What is this?"}, block]
    response = post(live_server, messages=[{"role": "user", "content": content}])
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"] == (
        f"messages.0.content.1: {kind} blocks are not supported: this model takes text only"
    )
    messages = tool_loop(["read_file"])
    messages[2]["content"][0]["content"] = [{"type": "text", "text": "a"}, block]
    nested = post(live_server, messages=messages, tools=[TOOL])
    assert nested.status_code == 400
    assert nested.json()["error"]["message"].startswith(
        f"messages.2.content.0.content.1: {kind} blocks are not supported"
    )


# -- 6. max_tokens and the context -------------------------------------------------------------


def words(n: int) -> list[dict]:
    return [{"role": "user", "content": " ".join(f"word{i}" for i in range(n))}]


def test_max_tokens_is_clamped_to_the_room(live_server: LiveServer) -> None:
    short, long = (count(live_server, messages=words(n))["input_tokens"] for n in (100, 200))
    n = 100 + int((CONTEXT - 60 - short) * 100 / (long - short))  # about 60 tokens of room
    messages = words(n)
    room = CONTEXT - count(live_server, messages=messages)["input_tokens"]
    assert 0 < room < 200, room
    body = {"messages": messages, "max_tokens": 100_000, "temperature": 0}
    response = post(live_server, **body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["output_tokens"] <= room
    with httpx.stream(
        "POST", live_server.url + "/v1/messages", timeout=60,
        json={"model": MODEL_NAME, **body, "stream": True},
    ) as streamed:  # fmt: skip
        assert streamed.status_code == 200
        delta = next(data for name, data in sse(streamed) if name == "message_delta")
    assert delta["usage"]["output_tokens"] <= room


def test_a_prompt_past_the_context_is_a_400(live_server: LiveServer) -> None:
    messages = words(1500)
    prompt = count(live_server, messages=messages)["input_tokens"]
    response = post(live_server, messages=messages, max_tokens=1)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message == f"prompt is too long: {prompt} tokens > {CONTEXT - 1} maximum"


# -- 7. beta header and query --------------------------------------------------------------


def test_unknown_betas_and_the_beta_query_are_accepted(live_server: LiveServer) -> None:
    headers = {"anthropic-beta": "no-such-beta-2099-01-01,another", "anthropic-version": "x"}
    messages = [{"role": "user", "content": "hi"}]
    for path, extra in (("/v1/messages?beta=true", {"max_tokens": 2}),
                        ("/v1/messages/count_tokens?beta=true", {})):  # fmt: skip
        body = {"model": MODEL_NAME, "messages": messages, **extra}
        response = httpx.post(live_server.url + path, json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
    message = client(live_server).beta.messages.create(
        model=MODEL_NAME, max_tokens=2, messages=messages, betas=["no-such-beta-2099-01-01"]
    )
    assert message.usage.output_tokens >= 1


# -- 8. Claude Code's billing header -------------------------------------------------------


def test_the_billing_header_is_left_out(live_server: LiveServer) -> None:
    messages = [{"role": "user", "content": "hi"}]

    def system(version: str) -> list[dict]:
        header = f"x-anthropic-billing-header: cc_version={version}; cc_entrypoint=cli;"
        return [{"type": "text", "text": header}, {"type": "text", "text": "You help."}]

    plain = count(live_server, messages=messages, system="You help.")["input_tokens"]
    assert count(live_server, messages=messages, system=system("2.1.3.a1"))["input_tokens"] == plain
    assert count(live_server, messages=messages, system=system("2.1.9.ff"))["input_tokens"] == plain
    inline = [{"role": "system", "content": system("2.1.3.a1")}, *messages]
    assert count(live_server, messages=inline)["input_tokens"] == plain
