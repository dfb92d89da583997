"""Structured outputs on the three surfaces: OpenAI's `response_format` and vLLM's
`structured_outputs`, Anthropic's `output_config.format`, gRPC's `constraint`; the official
SDKs' `parse` helpers against a live server, raw bodies checked with `jsonschema`, `re` and
membership, and every bad constraint refused in its protocol's own shape.

The tiny model has random weights: its output is random, but it must match the constraint,
and the small schemas here leave it few tokens to finish in."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import anthropic
import grpc
import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.grammar_check import decodes
from tests.live_server import MODEL_NAME, LiveServer
from zerohop.api.anthropic import schema as anthropic_schema
from zerohop.api.anthropic.turns import output_grammar
from zerohop.api.errors import ApiError
from zerohop.api.grpc.service import _sampling_params as grpc_sampling_params
from zerohop.api.openai import schema as openai_schema
from zerohop.api.openai.output_format import chat_grammar, completion_grammar
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "Describe the weather as JSON."}]
MAX = 96  # enough for every small schema below to finish
LOOSE_MAX = 200  # for any JSON object, greedy
SEEDS = (1, 2, 3)


class Verdict(pydantic.BaseModel):
    label: Literal["cat", "dog", "fox"]
    ok: bool
    score: int = pydantic.Field(ge=0, le=9)
    note: str = pydantic.Field(max_length=6)


class Weather(pydantic.BaseModel):
    """Enums and booleans only: the Anthropic SDK moves length and range bounds into the
    description, so anything else could run on."""

    sky: Literal["clear", "cloudy", "rain"]
    windy: bool
    level: Literal[1, 2, 3]


def closed_by_hand(schema: Any) -> Any:
    """What the server promises of `schema` (an object has only the properties it names),
    written here apart from grammar.closed_schema so that a fault there cannot hide."""
    if isinstance(schema, list):
        return [closed_by_hand(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_by_hand(v) for k, v in schema.items() if k != "properties"}
    if "properties" in schema:
        out["properties"] = {k: closed_by_hand(v) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


SCHEMAS = {
    "nested objects": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "boolean"}, "c": {"enum": ["x", "y"]}},
                "required": ["b", "c"],
            },
            "d": {"type": "null"},
        },
        "required": ["a", "d"],
    },
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 5},
        "minItems": 1,
        "maxItems": 3,
    },
    "enum": {"enum": ["red", "green", 3, None, True]},
    "bounded integers": {
        "type": "object",
        "properties": {
            "x": {"type": "integer", "minimum": -3, "maximum": 3},
            "y": {"type": "integer", "exclusiveMinimum": 10, "maximum": 12},
        },
        "required": ["x", "y"],
    },
    "anyOf": {
        "anyOf": [
            {"type": "boolean"},
            {"type": "object", "properties": {"k": {"const": "v"}}, "required": ["k"]},
            {"type": "string", "pattern": "^[ab]{1,3}$"},
        ]
    },
    "short strings": {
        "type": "object",
        "properties": {
            "s": {"type": "string", "maxLength": 4},
            "t": {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 2},
        },
        "required": ["s", "t"],
    },
}


def openai_client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="any", max_retries=0)


def anthropic_client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="any", max_retries=0)


def post(server: LiveServer, path: str, **body: Any) -> httpx.Response:
    body = {"model": MODEL_NAME, **body}
    if path == CHAT_PATH:
        body.setdefault("messages", MESSAGES)
    elif path == COMPLETIONS_PATH:
        body.setdefault("prompt", "JSON:")
    return httpx.post(server.url + path, json=body, timeout=120)


def output(response: httpx.Response) -> tuple[str, str]:
    """(text, finish_reason) of a 200 OpenAI response."""
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, choice["finish_reason"]


def finished(server: LiveServer, path: str, **body: Any) -> list[str]:
    """The outputs of a few seeds, each of which must finish (the schemas here are small)."""
    texts = []
    for seed in SEEDS:
        text, reason = output(post(server, path, seed=seed, max_tokens=MAX, **body))
        assert reason == "stop", (body, text)
        texts.append(text)
    return texts


def any_object(server: LiveServer, path: str, **body: Any) -> str:
    """A constraint that allows long strings (any JSON object): on the random model a random
    sample seldom closes its strings, so greedy decoding (which does, in ~100 tokens)."""
    text, reason = output(post(server, path, temperature=0, max_tokens=LOOSE_MAX, **body))
    assert reason == "stop", text
    return text


def check_openai_error(response: httpx.Response, param: str, words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert words in error["message"], error


def check_anthropic_error(response: httpx.Response, words: str) -> None:
    assert response.status_code == 400, response.text
    payload = response.json()
    assert payload["type"] == "error"
    assert payload["error"]["type"] == "invalid_request_error"
    assert words in payload["error"]["message"], payload
    assert payload["request_id"] == response.headers["request-id"]


def still_serves(server: LiveServer) -> None:
    text, _ = output(post(server, COMPLETIONS_PATH, max_tokens=1))
    assert isinstance(text, str)


# -- request checks (no server) -----------------------------------------------------------


def chat_request(**fields: Any) -> openai_schema.ChatRequest:
    body = {"model": MODEL_NAME, "messages": MESSAGES, **fields}
    return openai_schema.decode(json.dumps(body).encode(), openai_schema.ChatRequest)


def grammar_error(**fields: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        chat_grammar(chat_request(**fields))
    assert info.value.status == 400
    return info.value


def admits(folder: Path, grammar: str | None, accepted: str, refused: str) -> bool:
    assert grammar is not None
    return decodes(folder, grammar, accepted) and not decodes(folder, grammar, refused)


def test_response_formats_become_grammars(llama_dir: Path) -> None:
    assert chat_grammar(chat_request()) is None
    assert chat_grammar(chat_request(response_format={"type": "text"})) is None
    json_object = chat_grammar(chat_request(response_format={"type": "json_object"}))
    assert admits(llama_dir, json_object, '{"x": 1}', "[1]")
    spec = {"name": "v", "schema": {"type": "boolean"}, "strict": True, "description": "d"}
    boolean = chat_grammar(
        chat_request(response_format={"type": "json_schema", "json_schema": spec})
    )
    assert admits(llama_dir, boolean, "true", '"true"')
    any_object = {"type": "json_schema", "json_schema": {"name": "any"}}  # no schema
    assert chat_grammar(chat_request(response_format=any_object)) == chat_grammar(
        chat_request(response_format={"type": "json_object"})
    )


BAD_FORMATS = {
    "no type": ({}, "response_format.type", "Missing required parameter"),
    "unknown type": ({"type": "yaml"}, "response_format", "'yaml' is not supported"),
    "no json_schema": ({"type": "json_schema"}, "response_format.json_schema", "Missing"),
    "no name": (
        {"type": "json_schema", "json_schema": {"schema": {}}},
        "response_format.json_schema.name",
        "Missing required parameter: 'response_format.json_schema.name'",
    ),
    "bad name": (
        {"type": "json_schema", "json_schema": {"name": "a b"}},
        "response_format.json_schema.name",
        "letters, digits",
    ),
    "unknown key": (
        {"type": "json_schema", "json_schema": {"name": "a", "shema": {}}},
        "response_format.json_schema.shema",
        "Unrecognized request argument supplied",
    ),
    "strict not a bool": (
        {"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}},
        "response_format.json_schema.strict",
        "boolean",
    ),
    "schema not an object": (
        {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}},
        "response_format.json_schema.schema",
        "JSON schema object",
    ),
    "bad schema": (
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "frog"}}},
        "response_format",
        "response_format.json_schema.schema: the JSON schema cannot be compiled",
    ),
}


@pytest.mark.parametrize("case", BAD_FORMATS.values(), ids=BAD_FORMATS.keys())
def test_bad_response_formats(case: tuple[dict, str, str]) -> None:
    fmt, param, words = case
    error = grammar_error(response_format=fmt)
    assert error.param == param
    assert words in error.message


def test_structured_outputs_need_exactly_one_constraint(llama_dir: Path) -> None:
    for so in ({}, {"json_object": False}, {"regex": "a", "choice": ["a"]}):
        error = grammar_error(structured_outputs=so)
        assert error.param == "structured_outputs"
        assert "exactly one of" in error.message
    both = grammar_error(response_format={"type": "json_object"}, structured_outputs={"regex": "a"})
    assert both.param == "structured_outputs" and "together" in both.message
    body = {"model": MODEL_NAME, "prompt": "x", "structured_outputs": {"choice": ["a", "b"]}}
    request = openai_schema.decode(json.dumps(body).encode(), openai_schema.CompletionRequest)
    assert admits(llama_dir, completion_grammar(request), "b", "c")


def anthropic_request(**fields: Any) -> anthropic_schema.MessagesRequest:
    body = {"model": MODEL_NAME, "max_tokens": 8, "messages": MESSAGES, **fields}
    return anthropic_schema.decode_messages(json.dumps(body).encode())


def test_anthropic_output_formats(llama_dir: Path) -> None:
    fmt = {"type": "json_schema", "schema": Weather.model_json_schema()}
    assert output_grammar(anthropic_request()) is None
    assert output_grammar(anthropic_request(output_config={"effort": "low"})) is None
    weather = output_grammar(anthropic_request(output_config={"format": fmt}))
    good = '{"sky": "rain", "windy": true, "level": 2}'
    assert admits(llama_dir, weather, good, good.replace('"rain"', '"snow"'))
    assert output_grammar(anthropic_request(output_format=fmt)) == weather  # the beta's spelling
    with pytest.raises(ApiError, match="not both"):
        output_grammar(anthropic_request(output_config={"format": fmt}, output_format=fmt))
    prefill = [*MESSAGES, {"role": "assistant", "content": "{"}]
    with pytest.raises(ApiError, match="prefilled"):
        output_grammar(anthropic_request(output_config={"format": fmt}, messages=prefill))
    bad = {"type": "json_schema", "schema": {"type": "frog"}}
    with pytest.raises(ApiError) as info:
        output_grammar(anthropic_request(output_config={"format": bad}))
    assert info.value.message.startswith("output_config.format.schema: the JSON schema")


def test_grpc_sampling_fields_reach_sampling_params(llama_dir: Path) -> None:
    request = pb.GenerateRequest(
        model=MODEL_NAME,
        prompt="x",
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        min_p=0.1,
        min_tokens=2,
        logit_bias={7: -100.0},
        constraint=pb.Constraint(choice=pb.Choices(choices=["yes", "no"])),
    )
    params = grpc_sampling_params(request, vocab_size=512)
    assert (params.presence_penalty, params.frequency_penalty) == pytest.approx((0.5, -0.5))
    assert params.repetition_penalty == pytest.approx(1.2)
    assert params.min_p == pytest.approx(0.1) and params.min_tokens == 2
    assert params.logit_bias == {7: -100.0} and admits(llama_dir, params.grammar, "no", "maybe")
    neutral = grpc_sampling_params(pb.GenerateRequest(model=MODEL_NAME, prompt="x"), 512)
    assert neutral.repetition_penalty == 1.0 and neutral.presence_penalty == 0.0
    assert neutral.logit_bias is None and neutral.grammar is None
    with pytest.raises(ApiError, match="logit_bias: 512 is not a token id"):
        grpc_sampling_params(pb.GenerateRequest(logit_bias={512: 1.0}), 512)


# -- OpenAI SDK -------------------------------------------------------------------------------


def test_openai_sdk_parse(live_server: LiveServer) -> None:
    sdk = openai_client(live_server)
    for seed in SEEDS:
        got = sdk.chat.completions.parse(
            model=MODEL_NAME, messages=MESSAGES, response_format=Verdict, max_tokens=MAX, seed=seed
        )
        message = got.choices[0].message
        assert isinstance(message.parsed, Verdict)
        assert Verdict.model_validate_json(message.content) == message.parsed


def test_openai_sdk_parse_truncated(live_server: LiveServer) -> None:
    sdk = openai_client(live_server)
    with pytest.raises(openai.LengthFinishReasonError) as info:
        sdk.chat.completions.parse(
            model=MODEL_NAME, messages=MESSAGES, response_format=Verdict, max_tokens=3
        )
    choice = info.value.completion.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content.lstrip().startswith("{")


def test_openai_sdk_bad_schema(live_server: LiveServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frog"}}}
    with pytest.raises(openai.BadRequestError) as info:
        openai_client(live_server).chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, response_format=fmt
        )
    assert info.value.param == "response_format"
    assert "cannot be compiled" in info.value.message


# -- Anthropic SDK ----------------------------------------------------------------------------


def test_anthropic_sdk_parse(live_server: LiveServer) -> None:
    sdk = anthropic_client(live_server)
    for seed in SEEDS[:2]:
        got = sdk.messages.parse(
            model=MODEL_NAME,
            max_tokens=MAX,
            messages=MESSAGES,
            output_format=Weather,
            extra_body={"metadata": {"user_id": f"seed-{seed}"}},
        )
        assert got.stop_reason == "end_turn"
        assert isinstance(got.parsed_output, Weather)
        assert Weather.model_validate_json(got.content[0].text) == got.parsed_output


def test_anthropic_output_config_truncated(live_server: LiveServer) -> None:
    fmt = {"type": "json_schema", "schema": Weather.model_json_schema()}
    got = anthropic_client(live_server).messages.create(
        model=MODEL_NAME,
        max_tokens=3,
        messages=MESSAGES,
        output_config={"format": fmt, "effort": "high"},
    )
    assert got.stop_reason == "max_tokens"
    assert got.content[0].text.lstrip().startswith("{")


def test_anthropic_beta_output_format(live_server: LiveServer) -> None:
    """Older SDKs' `beta.messages.parse` sent the schema as a top-level `output_format`."""
    body = {
        "model": MODEL_NAME,
        "max_tokens": MAX,
        "messages": MESSAGES,
        "output_format": {"type": "json_schema", "schema": SCHEMAS["nested objects"]},
    }
    headers = {"anthropic-beta": "structured-outputs-2025-11-13"}
    response = httpx.post(live_server.url + "/v1/messages", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    message = response.json()
    assert message["stop_reason"] == "end_turn", message
    closed = closed_by_hand(SCHEMAS["nested objects"])  # as the server closed it: no extra keys
    jsonschema.validate(json.loads(message["content"][0]["text"]), closed)


ANTHROPIC_BAD = {
    "bad schema": (
        {"output_config": {"format": {"type": "json_schema", "schema": {"type": "frog"}}}},
        "output_config.format.schema: the JSON schema cannot be compiled",
    ),
    "no schema": (
        {"output_config": {"format": {"type": "json_schema"}}},
        "output_config.format.schema: Field required",
    ),
    "wrong type": (
        {"output_config": {"format": {"type": "regex", "schema": {}}}},
        "output_config.format.type",
    ),
    "unknown key": ({"output_config": {"colour": "red"}}, "Extra inputs are not permitted"),
    "bad effort": ({"output_config": {"effort": "huge"}}, "output_config.effort"),
}


@pytest.mark.parametrize("case", ANTHROPIC_BAD.values(), ids=ANTHROPIC_BAD.keys())
def test_anthropic_bad_output_config(live_server: LiveServer, case: tuple[dict, str]) -> None:
    fields, words = case
    body = {"model": MODEL_NAME, "max_tokens": 4, "messages": MESSAGES, **fields}
    response = httpx.post(live_server.url + "/v1/messages", json=body, timeout=60)
    check_anthropic_error(response, words)
    still_serves(live_server)


# -- raw HTTP: OpenAI response_format and vLLM structured_outputs ------------------------------


def test_json_object(live_server: LiveServer) -> None:
    text = any_object(live_server, CHAT_PATH, response_format={"type": "json_object"})
    assert isinstance(json.loads(text), dict)
    # vLLM's spelling is the same grammar: the same greedy output.
    assert any_object(live_server, CHAT_PATH, structured_outputs={"json_object": True}) == text


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schemas(live_server: LiveServer, name: str) -> None:
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    for text in finished(live_server, CHAT_PATH, response_format=fmt):
        jsonschema.validate(json.loads(text), closed_by_hand(schema))


def test_json_schema_stream(live_server: LiveServer) -> None:
    schema = SCHEMAS["nested objects"]
    stream = openai_client(live_server).chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=MAX,
        stream=True,
        extra_body={"structured_outputs": {"json": json.dumps(schema)}},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), closed_by_hand(schema))


def test_structured_outputs_on_completions(live_server: LiveServer) -> None:
    pattern = r"[a-c]{2,4}-[0-9]{1,2}"
    for seed in SEEDS:
        text, reason = output(
            post(
                live_server,
                COMPLETIONS_PATH,
                seed=seed,
                max_tokens=MAX,
                structured_outputs={"regex": pattern},
            )
        )
        assert reason == "stop" and re.fullmatch(pattern, text), text
    choices = ["alpha", "beta", "gamma delta"]
    for seed in SEEDS:
        so = {"choice": choices}
        text, reason = output(post(live_server, COMPLETIONS_PATH, seed=seed, structured_outputs=so))
        assert reason == "stop" and text in choices


def test_structured_outputs_on_chat(live_server: LiveServer) -> None:
    lark = 'start: "(" item ("," item)? ")"\nitem: /[xyz]/ | "nil"'
    gbnf = 'root ::= "on" | "off" | "n/a"'
    cases = [
        ({"grammar": lark}, lambda t: re.fullmatch(r"\((?:[xyz]|nil)(?:,(?:[xyz]|nil))?\)", t)),
        ({"grammar": gbnf}, lambda t: t in ("on", "off", "n/a")),
        ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        # [0-9], not \d: the backend's \d is Unicode 16's digits, Python 3.11's re knows fewer.
        ({"regex": r"[0-9]{3}"}, lambda t: re.fullmatch(r"[0-9]{3}", t)),
    ]
    for so, matches in cases:
        text, reason = output(post(live_server, CHAT_PATH, max_tokens=MAX, structured_outputs=so))
        assert reason == "stop" and matches(text), (so, text)


OPENAI_BAD = {
    "bad schema": (
        CHAT_PATH,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "required": 5}},
            }
        },
        "response_format",
    ),
    "no name": (
        CHAT_PATH,
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "response_format.json_schema.name",
    ),
    "bad regex": (COMPLETIONS_PATH, {"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    "bad grammar": (
        CHAT_PATH,
        {"structured_outputs": {"grammar": "start: nope"}},
        "structured_outputs",
    ),
    "bad json text": (CHAT_PATH, {"structured_outputs": {"json": "{oops"}}, "structured_outputs"),
    "empty choice": (CHAT_PATH, {"structured_outputs": {"choice": []}}, "structured_outputs"),
    "two constraints": (
        COMPLETIONS_PATH,
        {"structured_outputs": {"regex": "a", "json_object": True}},
        "structured_outputs",
    ),
    "unknown field": (
        CHAT_PATH,
        {"structured_outputs": {"yaml": "a"}},
        "structured_outputs.yaml",
    ),
    "both kinds": (
        CHAT_PATH,
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
    ),
}


@pytest.mark.parametrize("case", OPENAI_BAD.values(), ids=OPENAI_BAD.keys())
def test_openai_bad_constraints(live_server: LiveServer, case: tuple[str, dict, str]) -> None:
    path, fields, param = case
    response = post(live_server, path, max_tokens=4, **fields)
    check_openai_error(response, param, "")
    still_serves(live_server)


# -- gRPC -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stub(live_server: LiveServer):
    with grpc.insecure_channel(f"127.0.0.1:{live_server.grpc_port}") as channel:
        yield pb_grpc.ZerohopStub(channel)


def generate(stub: pb_grpc.ZerohopStub, **fields: Any) -> tuple[str, int]:
    fields.setdefault("max_tokens", MAX)
    request = pb.GenerateRequest(model=MODEL_NAME, prompt="Answer:", **fields)
    messages = list(stub.Generate(request, timeout=60))
    return "".join(m.text for m in messages), messages[-1].finish_reason


def test_grpc_constrained_generate(stub: pb_grpc.ZerohopStub) -> None:
    text, reason = generate(
        stub, constraint=pb.Constraint(choice=pb.Choices(choices=["up", "down"]))
    )
    assert reason == pb.FINISH_REASON_STOP and text in ("up", "down")
    text, reason = generate(stub, constraint=pb.Constraint(regex=r"[0-7]{2}"), seed=4)
    assert reason == pb.FINISH_REASON_STOP and re.fullmatch(r"[0-7]{2}", text)
    schema = SCHEMAS["bounded integers"]
    constraint = pb.Constraint(json_schema=json.dumps(schema))
    text, reason = generate(stub, constraint=constraint, presence_penalty=0.5, min_p=0.01)
    assert reason == pb.FINISH_REASON_STOP
    jsonschema.validate(json.loads(text), closed_by_hand(schema))


GRPC_BAD = {
    "bad schema": (pb.Constraint(json_schema='{"type": "frog"}'), "constraint.json_schema"),
    "bad regex": (pb.Constraint(regex="(("), "constraint.regex"),
    "bad grammar": (pb.Constraint(grammar="start: nope"), "constraint.grammar"),
    "empty": (pb.Constraint(), "set one of"),
    "json_object false": (pb.Constraint(json_object=False), "set one of"),
}


@pytest.mark.parametrize("case", GRPC_BAD.values(), ids=GRPC_BAD.keys())
def test_grpc_bad_constraint(stub: pb_grpc.ZerohopStub, case: tuple[pb.Constraint, str]) -> None:
    constraint, words = case
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, constraint=constraint)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.details()
    assert generate(stub, max_tokens=1)[0] is not None
