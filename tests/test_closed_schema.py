"""Closing a caller's JSON schema (`closed_schema`: objects allow no property they do not
name), checked with the real `jsonschema` validator: a zod-style `allOf` of two objects is
closed as one merged object, not branch by branch (which would admit no object at all)."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest

from tests.grammar_check import decodes
from zerohop.engine.structured.grammar import closed_schema, json_schema_grammar

ZOD_ALL_OF = {
    "allOf": [
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]},
    ]
}


def valid(schema: dict, value: object) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_an_all_of_of_objects_is_closed_as_one_object(llama_dir: Path) -> None:
    closed = closed_schema(ZOD_ALL_OF)
    assert valid(closed, {"a": "x", "b": 1})
    assert not valid(closed, {"a": "x", "b": 1, "c": True})  # closed
    assert not valid(closed, {"a": "x"})  # both branches' required names kept
    assert not valid(closed, {"a": "x", "b": "not an integer"})
    grammar = json_schema_grammar(ZOD_ALL_OF)  # and so the grammar the server compiles
    assert decodes(llama_dir, grammar, '{"a": "x", "b": 1}')
    assert not decodes(llama_dir, grammar, '{"a": "x", "b": 1, "c": true}')


def test_a_property_two_branches_name_must_meet_both() -> None:
    schema = {
        "allOf": [
            {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
            {"type": "object", "properties": {"n": {"minimum": 10}, "m": {"type": "string"}}},
        ]
    }
    closed = closed_schema(schema)
    assert valid(closed, {"n": 12, "m": "x"})
    assert not valid(closed, {"n": 3})  # the second branch's minimum kept
    assert not valid(closed, {"n": 12.5})  # and the first's type
    assert not valid(closed, {"n": 12, "z": 0})


def test_objects_are_closed_at_every_depth_unless_they_say_otherwise() -> None:
    schema = {
        "type": "object",
        "properties": {"inner": {"type": "object", "properties": {"x": {"type": "number"}}}},
        "additionalProperties": {"type": "string"},
    }
    closed = closed_schema(schema)
    assert valid(closed, {"inner": {"x": 1}, "extra": "kept open by its schema"})
    assert not valid(closed, {"inner": {"x": 1, "y": 2}})


@pytest.mark.parametrize(
    "branches",
    [
        [{"$ref": "#/$defs/A"}, {"properties": {"b": {"type": "integer"}}}],
        [{"type": "object", "properties": {"a": {}}, "minProperties": 1}],
    ],
)
def test_an_all_of_with_more_than_plain_objects_is_left_as_it_was(branches: list) -> None:
    schema = {"allOf": branches}
    assert closed_schema(schema)["allOf"] == [closed_schema(b) for b in branches]
