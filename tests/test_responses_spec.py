"""The Responses surface's objects and events against the Open Responses specification
(openresponses/openresponses, 2026-04-24) and OpenAI's API reference, beyond the schemas
(tests/test_responses_openapi.py validates every object kind against the spec's own OpenAPI
document; these tests use the same validators, tests/openresponses.py): function tools echoed
normalized, `completed_at` set only once completed, sequence numbers 0, 1, ... and each
`item_id` the item at its `output_index`, the stored response equal to the streamed one, an
incomplete and a cancelled response's fields, `presence_penalty` and `frequency_penalty`
echoed, range-checked (400 in the API's shape) and applied. Clients: raw httpx (the JSON as
sent) and the official openai SDK (it must accept every object). The server is the session's
shared `live_server` on the tiny random model, so outputs mean nothing: forced calls give a
`completed` response, `max_output_tokens` an `incomplete` one.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from tests.openresponses import event_violations, violations

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


def event_problems(events: list[dict[str, Any]]) -> list[str]:
    """Every event against the spec's schema of its type, their sequence numbers 0, 1, ...,
    and each `item_id` the item at its `output_index`."""
    found = event_violations(events, "event")
    items: dict[int, str] = {}
    for n, event in enumerate(events):
        where = f"event[{n}] {event.get('type')}"
        if event.get("sequence_number") != n:
            found.append(f"{where}: sequence_number {event.get('sequence_number')} != {n}")
        if "item" in event:
            items[event["output_index"]] = event["item"].get("id")
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
    assert violations("ResponseResource", whole) == []
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
    assert violations("ResponseResource", stored) == [] and stored == final
    listed = http.get(f"/responses/{final['id']}/input_items").json()
    assert [violations("ItemField", i) for i in listed["data"]] == [[]]

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
    assert violations("ResponseResource", queued) == [] and queued["status"] == "queued"
    assert queued["completed_at"] is None
    for _ in range(400):
        polled = http.get(f"/responses/{queued['id']}").json()
        if polled["status"] not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert violations("ResponseResource", polled) == [] and polled["status"] == "completed"
    assert isinstance(polled["completed_at"], int)

    running = create(http, background=True, max_output_tokens=2000)
    cancelled = http.post(f"/responses/{running['id']}/cancel").json()
    assert violations("ResponseResource", cancelled) == [] and cancelled["status"] == "cancelled"
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
    assert violations("ErrorPayload", error) == [] and error["param"] == field
    missing = http.get("/responses/resp_nothing")
    assert missing.status_code == 404 and violations("ErrorPayload", missing.json()["error"]) == []


def test_the_penalties_change_what_greedy_decoding_picks(http: httpx.Client) -> None:
    def text(**penalties: float) -> str:
        body = create(http, temperature=0, max_output_tokens=24, store=False, **penalties)
        return "".join(p["text"] for i in body["output"] for p in i.get("content", []))

    plain = text()
    assert text() == plain  # greedy: the same answer each time
    assert text(presence_penalty=2.0) != plain
    assert text(frequency_penalty=2.0) != plain
