"""The Responses surface's objects and events against the Open Responses specification
(openresponses/openresponses, 2026-04-24) and OpenAI's API reference: every field the spec
requires, of its type, in whole responses, every streamed event, a background response as
retrieved, an incomplete one, a cancelled one, listed input items and HTTP error bodies;
function tools echoed normalized; `presence_penalty` and `frequency_penalty` applied.

The required-field table below is written from the spec's schemas (ResponseResource, Usage,
Error, the ItemField and content-part unions, FunctionTool, the streaming events); a field
this server adds is allowed, a missing or mistyped one is a failure. Clients: raw httpx (the
JSON as sent) and the official openai SDK (it must accept every object). The server is the
session's shared `live_server` on the tiny random model, so outputs mean nothing: forced
calls give a `completed` response, `max_output_tokens` an `incomplete` one.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.live_server import MODEL_NAME, LiveServer

NUM = (int, float)
STR, INT, BOOL, LIST, DICT, NONE = str, int, bool, list, dict, type(None)

RESPONSE = {
    "id": STR,
    "object": STR,
    "created_at": INT,
    "completed_at": (INT, NONE),
    "status": STR,
    "incomplete_details": (DICT, NONE),
    "model": STR,
    "previous_response_id": (STR, NONE),
    "instructions": (STR, LIST, NONE),
    "output": LIST,
    "error": (DICT, NONE),
    "tools": LIST,
    "tool_choice": (STR, DICT),
    "truncation": STR,
    "parallel_tool_calls": BOOL,
    "text": DICT,
    "top_p": NUM,
    "presence_penalty": NUM,
    "frequency_penalty": NUM,
    "top_logprobs": INT,
    "temperature": NUM,
    "reasoning": (DICT, NONE),
    "user": (STR, NONE),
    "usage": (DICT, NONE),
    "max_output_tokens": (INT, NONE),
    "max_tool_calls": (INT, NONE),
    "store": BOOL,
    "background": BOOL,
    "service_tier": STR,
    "metadata": DICT,
    "safety_identifier": (STR, NONE),
    "prompt_cache_key": (STR, NONE),
}
SPEC: dict[str, dict[str, Any]] = {
    "response": RESPONSE,
    "usage": {
        "input_tokens": INT,
        "output_tokens": INT,
        "total_tokens": INT,
        "input_tokens_details": DICT,
        "output_tokens_details": DICT,
    },
    "input_tokens_details": {"cached_tokens": INT},
    "output_tokens_details": {"reasoning_tokens": INT},
    "error": {"code": STR, "message": STR},
    "incomplete_details": {"reason": STR},
    "http_error": {"message": STR, "type": STR, "param": (STR, NONE), "code": (STR, NONE)},
    # items (ItemField), by type
    "message": {"type": STR, "id": STR, "status": STR, "role": STR, "content": LIST},
    "function_call": {
        "type": STR, "id": STR, "call_id": STR, "name": STR, "arguments": STR, "status": STR,
    },
    "function_call_output": {
        "type": STR, "id": STR, "call_id": STR, "output": (STR, LIST), "status": STR,
    },
    "reasoning": {"type": STR, "id": STR, "summary": LIST},
    # content parts, by type
    "output_text": {"type": STR, "text": STR, "annotations": LIST},
    "input_text": {"type": STR, "text": STR},
    "reasoning_text": {"type": STR, "text": STR},
    # tools: FunctionTool as the response lists it
    "function": {
        "type": STR, "name": STR, "description": (STR, NONE), "parameters": (DICT, NONE),
        "strict": (BOOL, NONE),
    },
}  # fmt: skip
_AT = {"item_id": STR, "output_index": INT}
_PART_AT = {**_AT, "content_index": INT}
EVENTS: dict[str, dict[str, Any]] = {
    **{
        f"response.{s}": {"response": DICT}
        for s in ("created", "queued", "in_progress", "completed", "failed", "incomplete")
    },
    "response.output_item.added": {"output_index": INT, "item": DICT},
    "response.output_item.done": {"output_index": INT, "item": DICT},
    "response.content_part.added": {**_PART_AT, "part": DICT},
    "response.content_part.done": {**_PART_AT, "part": DICT},
    "response.output_text.delta": {**_PART_AT, "delta": STR},
    "response.output_text.done": {**_PART_AT, "text": STR},
    "response.reasoning_text.delta": {**_PART_AT, "delta": STR},
    "response.reasoning_text.done": {**_PART_AT, "text": STR},
    "response.function_call_arguments.delta": {**_AT, "delta": STR},
    "response.function_call_arguments.done": {**_AT, "arguments": STR},
}
WEATHER = {  # no description, no strict: echoed with description null and strict true
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
BARE = {"type": "function", "name": "ping", "strict": False}  # no parameters: null
FORCED = {"tools": [WEATHER, BARE], "tool_choice": {"type": "function", "name": "get_weather"}}


def problems(kind: str, obj: Any, where: str = "") -> list[str]:
    """Where `obj` (a `kind` of SPEC) misses a required field or has one of a wrong type,
    and the same for the objects inside it."""
    where = where or kind
    if not isinstance(obj, dict):
        return [f"{where}: not an object"]
    found = []
    for name, types in SPEC[kind].items():
        if name not in obj:
            found.append(f"{where}.{name}: missing")
        elif not _typed(obj[name], types):
            found.append(f"{where}.{name}: {obj[name]!r} is not {types}")
    return found + [p for k, v, at in _inner(kind, obj, where) for p in problems(k, v, at)]


def _typed(value: Any, types: Any) -> bool:
    if isinstance(value, bool) and types in (INT, NUM):
        return False  # a bool is no integer here
    return isinstance(value, types)


NESTED = {
    "response": ("usage", "error", "incomplete_details"),
    "usage": ("input_tokens_details", "output_tokens_details"),
}


def _inner(kind: str, obj: dict[str, Any], where: str) -> list[tuple[str, Any, str]]:
    """The objects inside `obj` with a shape of their own: (kind, object, where)."""
    inner = [(n, obj[n], f"{where}.{n}") for n in NESTED.get(kind, ()) if obj.get(n) is not None]
    if kind == "response":
        inner += [(i.get("type"), i, f"{where}.output[{n}]") for n, i in enumerate(obj["output"])]
        tools = enumerate(obj.get("tools") or [])
        inner += [
            ("function", t, f"{where}.tools[{n}]") for n, t in tools if t["type"] == "function"
        ]
    if kind in ("message", "reasoning"):
        parts = enumerate(obj.get("content") or [])
        inner += [(p.get("type"), p, f"{where}.content[{n}]") for n, p in parts]
    return [(k, v, at) for k, v, at in inner if k in SPEC]


def event_problems(events: list[dict[str, Any]]) -> list[str]:
    """Every event against its shape, their sequence numbers 0, 1, ..., each `item_id` the
    item at its `output_index`, and each snapshot or item inside them."""
    found = []
    items: dict[int, str] = {}
    for n, event in enumerate(events):
        kind = event.get("type")
        where = f"event[{n}] {kind}"
        if event.get("sequence_number") != n:
            found.append(f"{where}: sequence_number {event.get('sequence_number')} != {n}")
        if kind not in EVENTS:
            found.append(f"{where}: an event type the API does not name")
            continue
        shape = {"type": STR, "sequence_number": INT, **EVENTS[kind]}
        for name, types in shape.items():
            if not _typed(event.get(name, ...), types):
                found.append(f"{where}.{name}: {event.get(name, 'missing')!r} is not {types}")
        if "response" in event:
            found += problems("response", event["response"], f"{where}.response")
        if "item" in event:
            item = event["item"]
            items[event["output_index"]] = item.get("id")
            found += problems(item.get("type"), item, f"{where}.item")
        if "part" in event:
            found += problems(event["part"].get("type"), event["part"], f"{where}.part")
        if "item_id" in event and items.get(event["output_index"]) != event["item_id"]:
            found.append(f"{where}: item_id is not the item at output_index")
    return found


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]


@pytest.fixture(scope="module")
def http(live_server: LiveServer) -> httpx.Client:
    return httpx.Client(base_url=live_server.url + "/v1", timeout=120)


def create(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    answer = http.post("/responses", json={"model": MODEL_NAME, "input": "Hi.", **fields})
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def test_whole_streamed_and_stored_responses_hold_every_required_field(
    http: httpx.Client, live_server: LiveServer
) -> None:
    penalties = {"presence_penalty": 0.5, "frequency_penalty": -0.25}
    whole = create(http, **FORCED, **penalties, temperature=0)
    assert problems("response", whole) == []
    assert whole["status"] == "completed" and isinstance(whole["completed_at"], int)
    assert whole["completed_at"] >= whole["created_at"]
    assert (whole["presence_penalty"], whole["frequency_penalty"]) == (0.5, -0.25)
    assert whole["tools"] == [
        {**WEATHER, "description": None, "strict": True},
        {**BARE, "description": None, "parameters": None},
    ]
    assert [i["type"] for i in whole["output"]] == ["function_call"]

    with http.stream(
        "POST", "/responses", json={"model": MODEL_NAME, "input": "Hi.", "stream": True, **FORCED}
    ) as streamed:
        events = sse_events(streamed)
    assert event_problems(events) == []
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.function_call_arguments.done" in kinds
    assert [e["response"]["completed_at"] for e in events[:2]] == [None, None]
    final = events[-1]["response"]
    assert isinstance(final["completed_at"], int) and final["presence_penalty"] == 0.0

    stored = http.get(f"/responses/{final['id']}").json()
    assert problems("response", stored) == [] and stored == final
    listed = http.get(f"/responses/{final['id']}/input_items").json()
    assert [problems(i["type"], i) for i in listed["data"]] == [[]]

    # The SDK reads the same objects into its models.
    sdk = openai.OpenAI(base_url=live_server.url + "/v1", api_key="none", max_retries=0)
    parsed = sdk.responses.retrieve(final["id"])
    assert parsed.completed_at == final["completed_at"] and parsed.output[0].type == "function_call"


def test_incomplete_background_and_cancelled_responses_hold_every_required_field(
    http: httpx.Client,
) -> None:
    with http.stream(
        "POST",
        "/responses",
        json={"model": MODEL_NAME, "input": "Hi.", "stream": True, "max_output_tokens": 3},
    ) as streamed:
        events = sse_events(streamed)
    assert event_problems(events) == []
    cut = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["completed_at"] is None and cut["output"][0]["status"] == "incomplete"

    queued = create(http, background=True, **FORCED)
    assert problems("response", queued) == [] and queued["status"] == "queued"
    assert queued["completed_at"] is None
    for _ in range(400):
        polled = http.get(f"/responses/{queued['id']}").json()
        if polled["status"] not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert problems("response", polled) == [] and polled["status"] == "completed"
    assert isinstance(polled["completed_at"], int)

    running = create(http, background=True, max_output_tokens=2000)
    cancelled = http.post(f"/responses/{running['id']}/cancel").json()
    assert problems("response", cancelled) == [] and cancelled["status"] == "cancelled"
    assert cancelled["completed_at"] is None


@pytest.mark.parametrize(
    ("field", "value"), [("presence_penalty", 2.5), ("frequency_penalty", -2.01)]
)
def test_a_penalty_out_of_range_is_a_400_in_the_apis_shape(
    http: httpx.Client, field: str, value: float
) -> None:
    answer = http.post("/responses", json={"model": MODEL_NAME, "input": "Hi.", field: value})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert problems("http_error", error) == [] and error["param"] == field
    missing = http.get("/responses/resp_nothing")
    assert missing.status_code == 404 and problems("http_error", missing.json()["error"]) == []


def test_the_penalties_change_what_greedy_decoding_picks(http: httpx.Client) -> None:
    def text(**penalties: float) -> str:
        body = create(http, temperature=0, max_output_tokens=24, store=False, **penalties)
        return "".join(p["text"] for i in body["output"] for p in i.get("content", []))

    plain = text()
    assert text() == plain  # greedy: the same answer each time
    assert text(presence_penalty=2.0) != plain
    assert text(frequency_penalty=2.0) != plain
