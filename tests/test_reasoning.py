"""Reasoning (issue 21): the `<think>` parser under random splits, signatures, and extended
thinking on the Anthropic surface through the official SDK, against a live server on a copy
of the tiny qwen3 whose chat template is Qwen3-style (opens `<think>` in the generation
prompt unless `enable_thinking` is false)."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import anthropic
import grpc
import openai
import pytest

from tests.live_server import MODEL_NAME, LiveServer, with_chat_template
from zerohop.api.anthropic.blocks import ContentBlocks
from zerohop.api.anthropic.schema import MessagesRequest, decode_messages
from zerohop.api.anthropic.turns import conversation
from zerohop.api.conversation.events import OutputReader
from zerohop.api.conversation.reasoning import ReasoningParser, has_reasoning_format
from zerohop.api.errors import ApiError
from zerohop.api.serving.thought_signatures import ThoughtSignatures
from zerohop.client import ReplicaPool, http_client
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

THINK_MODEL = "tiny-qwen3-think"
THINK_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)
USER = [{"role": "user", "content": "Why is the sky blue?"}]
THINK = {"type": "enabled", "budget_tokens": 1024}
MAX = 1040
ADAPTIVE = {"type": "adaptive"}  # no budget: a short max_tokens keeps the test quick


def parse(pieces: list[str], in_thought: bool = False) -> tuple[str, str]:
    parser = ReasoningParser(in_thought)
    thought, answer = "", ""
    for i, piece in enumerate(pieces):
        t, a = parser.feed(piece, final=i == len(pieces) - 1)
        thought, answer = thought + t, answer + a
    return thought, answer


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


CASES = {
    "thought then answer": ("<think>\nabc </th\n</think>\n\nthe answer", False, "abc </th\n"),
    "opened by the prompt": ("\nwhy <t</think>\n\nok <think>", True, "why <t"),
    "no thought": ("  plain <think> text", False, ""),
    "unfinished thought": ("<think>\nstill </thin", False, "still </thin"),
}
ANSWERS = {
    "thought then answer": "the answer",
    "opened by the prompt": "ok <think>",
    "no thought": "plain <think> text",
    "unfinished thought": "",
}


@pytest.mark.parametrize("case", list(CASES))
def test_parser_random_splits(case: str) -> None:
    text, in_thought, thought = CASES[case]
    assert parse([text], in_thought) == (thought, ANSWERS[case])
    rng = random.Random(case)
    for _ in range(200):
        assert parse(random_split(text, rng), in_thought) == (thought, ANSWERS[case])


def test_detection() -> None:
    assert has_reasoning_format(THINK_TEMPLATE) and not has_reasoning_format("{{ x }}")


@pytest.fixture(scope="module")
def think_server(tiny_model, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("think") / "qwen3-think"
    with_chat_template(tiny_model("qwen3"), folder, THINK_TEMPLATE)
    server = LiveServer(folder, served_model_name=THINK_MODEL)
    server.start(tmp_path_factory.mktemp("think-log") / "server.log")
    yield server
    server.stop()


def client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="any", max_retries=0)


def test_thinking_blocks(think_server: LiveServer) -> None:
    # A budget needs max_tokens > 1024: a stop sequence ends this one early.
    kw = dict(model=THINK_MODEL, max_tokens=MAX, messages=USER, thinking=THINK)
    message = client(think_server).messages.create(**kw, stop_sequences=["e"])
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].signature
    kw = dict(kw, max_tokens=24, thinking=ADAPTIVE)
    message = client(think_server).messages.create(**kw)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking and message.content[0].signature
    events = []
    with client(think_server).messages.stream(**kw) as stream:
        events = [e for e in stream if e.type.startswith("content_block")]
        final = stream.get_final_message()
    assert events[0].type == "content_block_start" and events[0].content_block.type == "thinking"
    stop0 = next(i for i, e in enumerate(events) if e.type == "content_block_stop")
    assert events[stop0].index == 0 and events[stop0 - 1].delta.type == "signature_delta"
    assert all(e.delta.type == "thinking_delta" for e in events[1 : stop0 - 1])
    assert {e.index for e in events[stop0 + 1 :]} == {1}
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].signature

    signed = final.content[0].model_dump(exclude_none=True)
    history = [*USER, {"role": "assistant", "content": [signed, {"type": "text", "text": "x"}]}]
    again = dict(kw, max_tokens=8, thinking={"type": "disabled"})
    more = [*history, {"role": "user", "content": "And at night?"}]
    reply = client(think_server).messages.create(**dict(again, messages=more))
    assert [b.type for b in reply.content] == ["text"]
    # An edited thought is left out of the prompt, not refused (unless the server is strict:
    # tests/test_thought_signatures.py).
    forged = dict(signed, thinking=signed["thinking"] + " (edited)")
    more[1] = {"role": "assistant", "content": [forged, {"type": "text", "text": "x"}]}
    reply = client(think_server).messages.create(**dict(again, messages=more))
    assert [b.type for b in reply.content] == ["text"]


def test_budget_closes_the_thought(think_server: LiveServer) -> None:
    # Greedy, the random model never closes its thought on this prompt (nor ends within
    # 1300 tokens): only the budget ends it, and the answer has the rest of max_tokens.
    # Without a budget (adaptive) the thought takes all of max_tokens.
    story = [{"role": "user", "content": "Tell me a story."}]
    greedy = {"temperature": 0.0}  # not a parameter of this SDK version any more
    kw = dict(model=THINK_MODEL, max_tokens=MAX + 16, messages=story, extra_body=greedy)
    capped = client(think_server).messages.create(**kw, thinking=THINK)
    assert [b.type for b in capped.content] == ["thinking", "text"]
    assert capped.content[1].text
    with client(think_server).messages.stream(**kw, thinking=THINK) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in capped.content]
    free = client(think_server).messages.create(**kw, thinking=ADAPTIVE)
    assert free.stop_reason == "max_tokens" and free.usage.output_tokens == MAX + 16
    assert not "".join(b.text for b in free.content if b.type == "text")
    assert free.content[0].thinking.startswith(capped.content[0].thinking)
    assert len(free.content[0].thinking) > len(capped.content[0].thinking)


@pytest.mark.parametrize(
    "fields,error",
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "budget_tokens"),
        ({"thinking": THINK, "max_tokens": 1024}, "max_tokens"),
    ],
)
def test_thinking_refused(think_server: LiveServer, fields: dict, error: str) -> None:
    kw = {"model": THINK_MODEL, "max_tokens": MAX, "messages": USER, **fields}
    with pytest.raises(anthropic.BadRequestError, match=error):
        client(think_server).messages.create(**kw)


def test_no_reasoning_format() -> None:
    # Any thinking is accepted and answered without a thought (live on the tiny llama:
    # tests/test_anthropic_fields.py); the budget's rules still hold.
    body = {"model": MODEL_NAME, "max_tokens": MAX, "messages": USER, "thinking": THINK}
    for thinking in (THINK, ADAPTIVE, {"type": "disabled"}, {"type": "between_tools"}, None):
        conv = conversation(dict_request(body, thinking=thinking), "{{ messages }}")
        assert conv.reasoning.think is None and conv.reasoning.budget is None
    with pytest.raises(ApiError, match="max_tokens: must be greater"):
        conversation(dict_request(body, max_tokens=1024), "{{ messages }}")


def dict_request(body: dict, **fields) -> MessagesRequest:
    return decode_messages(json.dumps({**body, **fields}).encode())


def test_openai_reasoning_content(think_server: LiveServer) -> None:
    oai = openai.OpenAI(base_url=think_server.url + "/v1", api_key="any", max_retries=0)
    kw = dict(model=THINK_MODEL, max_tokens=16, messages=USER, reasoning_effort="low")
    message = oai.chat.completions.create(**kw).choices[0].message
    assert message.reasoning_content and message.reasoning == message.reasoning_content
    assert message.content == ""  # the random model never closes its thought
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert streamed and not "".join(d.content or "" for d in deltas)
    assert "<think>" not in streamed


def test_openai_thinking_token_budget(think_server: LiveServer) -> None:
    # vLLM's field: without it the random model's output is all thought (above); with it
    # the thought is closed after 8 tokens and the rest of max_tokens is the answer.
    oai = openai.OpenAI(base_url=think_server.url + "/v1", api_key="any", max_retries=0)
    extra = {"thinking_token_budget": 8, "ignore_eos": True, "seed": 5}
    kw = dict(model=THINK_MODEL, max_tokens=24, messages=USER, extra_body=extra)
    message = oai.chat.completions.create(**kw).choices[0].message
    assert message.reasoning_content and message.content
    assert "</think>" not in message.content and "</think>" not in message.reasoning_content
    deltas = [c.choices[0].delta for c in oai.chat.completions.create(**kw, stream=True)]
    streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert streamed == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content


def test_openai_reasoning_with_tools(think_server: LiveServer) -> None:
    # With tools offered, the thought is still split out (calls are read in the answer).
    oai = openai.OpenAI(base_url=think_server.url + "/v1", api_key="any", max_retries=0)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    extra = {"thinking_token_budget": 6, "ignore_eos": True, "seed": 2}
    kw = dict(model=THINK_MODEL, max_tokens=20, messages=USER, tools=[tool], extra_body=extra)
    message = oai.chat.completions.create(**kw).choices[0].message
    assert message.reasoning_content and message.content and "<think>" not in message.content
    deltas = [c.choices[0].delta for c in oai.chat.completions.create(**kw, stream=True)]
    assert "".join(d.content or "" for d in deltas) == message.content
    thought = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert thought == message.reasoning_content


def test_openai_thinking_token_budget_refused(
    think_server: LiveServer, live_server: LiveServer
) -> None:
    def create(server: LiveServer, model: str, **fields) -> None:
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="any", max_retries=0)
        oai.chat.completions.create(model=model, max_tokens=4, messages=USER, **fields)

    with pytest.raises(openai.BadRequestError, match="no reasoning format"):
        create(live_server, MODEL_NAME, extra_body={"thinking_token_budget": 8})
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        fmt = {"type": "json_object"}
        create(
            think_server, THINK_MODEL, response_format=fmt, extra_body={"thinking_token_budget": 8}
        )
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        create(think_server, THINK_MODEL, extra_body={"thinking_token_budget": -1})


def event_list(chunk: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in chunk.decode().splitlines() if line[:6] == "data: "]


@pytest.mark.parametrize("tools", [False, True])
def test_thinking_events(tools: bool) -> None:
    signer = asyncio.run(ThoughtSignatures().signer("m", "t", signs=True))
    reader, output = OutputReader(ReasoningParser(True)), ContentBlocks(True, tools, signer)
    assert event_list(output.opening())[0]["content_block"]["type"] == "thinking"
    chunk = output.events(reader.feed("a thought</thi")) + output.events(reader.feed("nk>\n\nhi"))
    chunk += output.events(reader.feed("!", True), True) + output.end()
    got = [(e["type"], e["index"], e.get("delta", {}).get("type")) for e in event_list(chunk)]
    assert got == [
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
    ]
    signature = event_list(chunk)[1]["delta"]["signature"]
    assert output.thought == "a thought" and signer.check("a thought", signature) == "verified"


EMPTY = {"type": "object", "properties": {}}  # closed by the server: only {} (a call ends soon)
TOOL = {"name": "f", "description": "", "input_schema": EMPTY}
OAI_TOOL = {"type": "function", "function": {"name": "f", "parameters": EMPTY}}


def test_a_thought_with_a_forced_call_is_one_rule_on_both_surfaces(
    think_server: LiveServer,
) -> None:
    """Asking for a thought with a forced call is the same 400 on Anthropic and OpenAI (its
    grammar writes the call from the first token); a thought not asked for is skipped."""
    anth = client(think_server)
    oai = openai.OpenAI(base_url=think_server.url + "/v1", api_key="any", max_retries=0)
    forced = {"type": "any"}
    kw = {"model": THINK_MODEL, "max_tokens": MAX, "messages": USER, "tools": [TOOL]}
    rule = "may not be enabled with a forced tool call"
    with pytest.raises(anthropic.BadRequestError, match=rule):
        anth.messages.create(**kw, tool_choice=forced, thinking=THINK)
    okw = {"model": THINK_MODEL, "max_tokens": 300, "messages": USER, "tools": [OAI_TOOL]}
    okw["temperature"] = 0.0
    with pytest.raises(openai.BadRequestError, match=rule):
        oai.chat.completions.create(
            **okw, tool_choice="required", extra_body={"thinking_token_budget": 8}
        )
    message = anth.messages.create(**{**kw, "max_tokens": 300}, tool_choice=forced)
    assert [b.type for b in message.content] == ["tool_use"]
    answer = oai.chat.completions.create(**okw, tool_choice="required").choices[0].message
    assert answer.tool_calls and answer.tool_calls[0].function.name == "f"
    assert getattr(answer, "reasoning_content", None) is None


def test_responses_reasoning_item(think_server: LiveServer) -> None:
    """The Responses API: the thought is a `reasoning` item streamed as reasoning_text
    deltas, counted as reasoning tokens; effort "none" asks the template not to think."""
    oai = openai.OpenAI(base_url=think_server.url + "/v1", api_key="any", max_retries=0)
    kw: dict = dict(model=THINK_MODEL, input="Hi.", max_output_tokens=12)
    events = list(oai.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" not in kinds
    final = events[-1].response  # type: ignore[union-attr]
    [item] = final.output  # the random model never closes its thought
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert item.type == "reasoning" and item.content[0].text == streamed and streamed
    assert "<think>" not in streamed
    usage = final.usage
    assert usage.output_tokens_details.reasoning_tokens == usage.output_tokens > 0
    quiet = oai.responses.create(**kw, reasoning={"effort": "none"})
    assert [i.type for i in quiet.output] == ["message"]


def test_grpc_thought_field(think_server: LiveServer) -> None:
    """gRPC reads the output as every surface does: the thought in `thought`, not in `text`,
    the same thought Chat returns for the same greedy request."""
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")])
    request = pb.GenerateRequest(
        model=THINK_MODEL, messages=messages, max_tokens=16, temperature=0.0
    )
    with grpc.insecure_channel(f"127.0.0.1:{think_server.grpc_port}") as channel:
        replies = list(pb_grpc.ZerohopStub(channel).Generate(request, timeout=60))
    thought = "".join(r.thought for r in replies)
    assert thought and "<think>" not in thought
    assert not "".join(r.text for r in replies)  # the random model never closes its thought
    oai = openai.OpenAI(base_url=think_server.url + "/v1", api_key="any", max_retries=0)
    chat = oai.chat.completions.create(
        model=THINK_MODEL,
        max_tokens=16,
        temperature=0,
        messages=[{"role": "user", "content": "Hi"}],
    )
    assert chat.choices[0].message.reasoning_content == thought


def test_chat_through_a_grpc_replica_keeps_the_thought(think_server: LiveServer) -> None:
    """zerohop.client's gRPC bridge gives Chat the thought as `reasoning_content`, whole and
    streamed, as the replica's own Chat surface does."""
    direct = openai.OpenAI(base_url=think_server.url + "/v1", api_key="k", max_retries=0)
    kw: dict[str, Any] = dict(model=THINK_MODEL, max_tokens=16, temperature=0, messages=USER)
    expected = direct.chat.completions.create(**kw).choices[0].message.reasoning_content
    pool = ReplicaPool([f"grpc://127.0.0.1:{think_server.grpc_port}"])
    try:
        http = http_client(pool=pool)
        bridged = openai.OpenAI(base_url="http://zerohop/v1", api_key="k", http_client=http)
        message = bridged.chat.completions.create(**kw).choices[0].message
        assert expected and message.reasoning_content == expected and not message.content
        chunks = bridged.chat.completions.create(**kw, stream=True)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == expected
    finally:
        pool.close()
