"""The OpenAI Responses API (issue 39) through the official openai SDK against a live server:
`responses.create` (whole, streamed, in the background), `.stream`, `.parse`, function and
custom tools, `previous_response_id` chains, stored responses (retrieve, input_items,
delete, cancel) and their tenant isolation.

The server runs the tiny random model with keys of two tenants; outputs mean nothing, so a
test checks the protocol: the SDK accepts every response and event, a forced call is valid
for its tool (a custom tool's input is a sentence of its Lark grammar, checked with the
`lark` parser Codex's grammars are written for), a chain's prompt holds the earlier turns.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lark
import openai
import pytest
from pydantic import BaseModel

from tests.live_server import MODEL_NAME, LiveServer
from zerohop.gateway.store.sqlite import KeyStore

PATCH_GRAMMAR = r"""
start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
filename: /[a-z]{1,8}\.txt/
add_line: "+" /[a-z ]{1,12}/ LF
%import common.LF
"""
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR},
}


@pytest.fixture(scope="module")
def keyed(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A server with a key of tenant acme and one of tenant other."""
    db = tmp_path_factory.mktemp("responses_keys") / "keys.db"
    store = KeyStore(db)
    keys = {tenant: store.create_key(tenant)[0] for tenant in ("acme", "other")}
    store.close()
    log = tmp_path_factory.mktemp("responses_server") / "server.log"
    audit = log.parent / "audit"
    server = LiveServer(llama_dir, ["--keys-db", str(db), "--audit-dir", str(audit)]).start(log)
    yield {"server": server, "keys": keys, "audit": audit}
    server.stop()


def client(keyed: dict[str, Any], tenant: str = "acme") -> openai.OpenAI:
    url = keyed["server"].url + "/v1"
    return openai.OpenAI(base_url=url, api_key=keyed["keys"][tenant], max_retries=0)


def test_a_string_input_gets_a_stored_completed_response(keyed: dict[str, Any]) -> None:
    c = client(keyed)
    response = c.responses.create(model=MODEL_NAME, input="Say hi.", max_output_tokens=4)
    assert response.id.startswith("resp_")
    assert response.status == "incomplete"  # 4 tokens of a random model: cut
    assert response.incomplete_details and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == message.content[0].text  # type: ignore[union-attr]
    usage = response.usage
    assert usage is not None and usage.output_tokens == 4 and usage.input_tokens > 3
    assert usage.total_tokens == usage.input_tokens + 4
    kept = c.responses.retrieve(response.id)
    assert kept.output_text == response.output_text and kept.status == "incomplete"


def test_a_response_is_audited_and_charged_as_the_keys_request(keyed: dict[str, Any]) -> None:
    from tests.test_gateway_limits import audit_records, wait_until

    # Greedy, so the answer is the same every run: cut at 3 tokens, not ended by a sampled EOS.
    response = client(keyed).responses.create(
        model=MODEL_NAME, input="Audit me.", max_output_tokens=3, temperature=0
    )
    request_id = "req_" + response.id.removeprefix("resp_")
    found = wait_until(
        lambda: [r for r in audit_records(keyed["audit"]) if r["request_id"] == request_id]
    )
    assert found, "no audit record for the response"
    [record] = found
    assert record["tenant"] == "acme" and record["surface"] == "openai"
    assert record["status"] == 200 and record["output_tokens"] == 3
    assert response.usage is not None
    assert record["input_tokens"] + record["cached_tokens"] == response.usage.input_tokens


def test_a_stream_sends_the_apis_events_in_order(keyed: dict[str, Any]) -> None:
    c = client(keyed)
    # Greedy, so the answer is the same every run: cut at 5 tokens, not ended by a sampled EOS.
    with c.responses.stream(
        model=MODEL_NAME, input="Say hi.", max_output_tokens=5, temperature=0
    ) as stream:
        events = list(stream)
    final = events[-1].response  # type: ignore[union-attr]  # cut: incomplete, as the API ends
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.usage is not None and final.usage.output_tokens == 5


def test_a_required_function_call_is_valid_for_its_tool(keyed: dict[str, Any]) -> None:
    c = client(keyed)
    with c.responses.stream(
        model=MODEL_NAME, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
        max_output_tokens=300,
    ) as stream:  # fmt: skip
        kinds = [e.type for e in stream]
        response = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    [call] = [i for i in response.output if i.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Oslo", "Lima")
    assert response.status == "completed"


def test_a_forced_custom_call_streams_input_in_its_grammar(keyed: dict[str, Any]) -> None:
    c = client(keyed)
    stream = c.responses.create(
        model=MODEL_NAME, input="Add a file.", tools=[PATCH],  # type: ignore[list-item]
        tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=400,
        temperature=0, stream=True,
    )  # fmt: skip
    events = list(stream)
    # Greedy, so the same every run: a sampled input could run past max_output_tokens and be
    # cut inside the grammar (an incomplete response, not a sentence of it).
    assert events[-1].type == "response.completed", events[-1].type
    done = [e for e in events if e.type == "response.output_item.done"]
    [item] = [e.item for e in done]
    assert item.type == "custom_tool_call" and item.name == "apply_patch"
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    assert "".join(deltas) == item.input
    lark.Lark(PATCH_GRAMMAR).parse(item.input)  # raises unless a sentence of the grammar


def test_a_function_call_and_its_output_continue_by_previous_response_id(
    keyed: dict[str, Any],
) -> None:
    c = client(keyed)
    first = c.responses.create(
        model=MODEL_NAME, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
        max_output_tokens=300,
    )  # fmt: skip
    [call] = [i for i in first.output if i.type == "function_call"]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    second = c.responses.create(
        model=MODEL_NAME, previous_response_id=first.id, input=[output],  # type: ignore[list-item]
        tools=[WEATHER], max_output_tokens=3,  # type: ignore[list-item]
    )  # fmt: skip
    assert second.previous_response_id == first.id
    assert second.usage and first.usage
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = c.responses.input_items.list(second.id, order="asc")
    kinds = [i.type for i in items.data]
    assert kinds == ["message", "function_call", "function_call_output"]
    assert items.data[1].call_id == call.call_id  # type: ignore[union-attr]


def test_a_chain_of_three_grows_its_prompt_by_each_turn(keyed: dict[str, Any]) -> None:
    c = client(keyed)
    previous, sizes = None, []
    for text in ("One.", "Two.", "Three."):
        response = c.responses.create(
            model=MODEL_NAME, input=text, previous_response_id=previous, max_output_tokens=2,
            temperature=0,
        )  # fmt: skip
        assert response.usage is not None
        sizes.append(response.usage.input_tokens)
        previous = response.id
    assert sizes[0] < sizes[1] < sizes[2]
    listed = c.responses.input_items.list(previous, order="asc")  # type: ignore[arg-type]
    texts = [i.content[0].text for i in listed.data if i.type == "message" and i.role == "user"]  # type: ignore[union-attr]
    assert texts == ["One.", "Two.", "Three."]


def test_parse_returns_the_pydantic_model(keyed: dict[str, Any]) -> None:
    class Answer(BaseModel):
        ok: bool

    response = client(keyed).responses.parse(
        model=MODEL_NAME, input="Is it sunny?", text_format=Answer, max_output_tokens=40
    )
    assert isinstance(response.output_parsed, Answer)


def test_another_tenants_response_is_not_found(keyed: dict[str, Any]) -> None:
    mine = client(keyed)
    response = mine.responses.create(model=MODEL_NAME, input="Hi.", max_output_tokens=2)
    theirs = client(keyed, "other")
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as refused:
        theirs.responses.create(
            model=MODEL_NAME, input="Go on.", previous_response_id=response.id, max_output_tokens=2
        )
    assert refused.value.code == "previous_response_not_found"
    assert mine.responses.retrieve(response.id).id == response.id  # unharmed
    mine.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(response.id)


def test_an_unstored_response_cannot_be_continued(keyed: dict[str, Any]) -> None:
    c = client(keyed)
    response = c.responses.create(model=MODEL_NAME, input="Hi.", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(response.id)


def test_a_background_response_is_polled_and_cancelled(keyed: dict[str, Any]) -> None:
    c = client(keyed)
    done = c.responses.create(model=MODEL_NAME, input="Hi.", background=True, max_output_tokens=3)
    assert done.status == "queued" and done.background
    for _ in range(200):
        polled = c.responses.retrieve(done.id)
        if polled.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert polled.status == "incomplete" and polled.usage and polled.usage.output_tokens == 3
    long = c.responses.create(
        model=MODEL_NAME, input="Hi.", background=True, max_output_tokens=2000
    )
    cancelled = c.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    time.sleep(0.5)
    assert c.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):  # only a background response is cancelled
        foreground = c.responses.create(model=MODEL_NAME, input="Hi.", max_output_tokens=1)
        c.responses.cancel(foreground.id)


def test_hosted_tools_and_new_fields_are_accepted(keyed: dict[str, Any]) -> None:
    c = client(keyed)
    response = c.responses.create(
        model=MODEL_NAME,
        instructions="Be brief.",
        input=[{"role": "developer", "content": "Answer in English."},
               {"role": "user", "content": [{"type": "input_text", "text": "Hi."}]}],
        tools=[{"type": "web_search"}, WEATHER],  # type: ignore[list-item]
        reasoning={"effort": "low", "summary": "auto"},
        text={"verbosity": "low"},
        include=["reasoning.encrypted_content"],
        prompt_cache_key="session-1",
        truncation="auto",
        max_output_tokens=2,
        extra_body={"client_metadata": {"x": "y"}},
    )  # fmt: skip
    assert response.prompt_cache_key == "session-1"
    assert response.instructions == "Be brief."


@pytest.mark.parametrize("arguments", ['{"city": "Osl', "[1, 2]", "not json"])
def test_a_calls_arguments_come_back_as_the_model_left_them(
    keyed: dict[str, Any], arguments: str
) -> None:
    # A call cut off by max_output_tokens has arguments that are no JSON object; an agent
    # sends it back as it came, and the API takes it (the model then sees that text).
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": arguments}
    output = {"type": "function_call_output", "call_id": "c1", "output": "Sunny"}
    response = client(keyed).responses.create(
        model=MODEL_NAME, input=[{"role": "user", "content": "Oslo?"}, call, output],  # type: ignore[list-item]
        tools=[WEATHER], max_output_tokens=2,  # type: ignore[list-item]
    )  # fmt: skip
    assert response.status in ("completed", "incomplete")


BAD_GRAMMAR = {"type": "grammar", "syntax": "lark", "definition": "start: ("}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": {"type": "custom", "name": "nope"}, "tools": [PATCH]}, "tool_choice"),
        ({"tools": [{**PATCH, "format": BAD_GRAMMAR}]}, "tools"),
        (
            {"input": [{"type": "function_call_output", "call_id": "x", "output": "y"}]},
            "input[0].call_id",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
    ],
)
def test_bad_requests_are_400s_naming_the_field(
    keyed: dict[str, Any], fields: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL_NAME, "input": "Hi.", "max_output_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        client(keyed).responses.create(**body)
    assert refused.value.param == param
