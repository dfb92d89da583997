"""A tool definition, checked where it enters: a name, a description and a JSON schema
for its arguments. The surfaces build these from their API's shapes.

A model's arguments are checked against the tool's schema before they become a call
(`ToolSet.valid`): the issue's promise is that an invalid call comes back as text, never as a
tool block the client would run. The schema itself is checked where it enters
(`checked_tools`), so a bad one is the client's 400, not every call silently becoming text.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import referencing.exceptions
from jsonschema.protocols import Validator
from jsonschema.validators import validator_for

from zerohop.api.tools.input_grammar import input_matches
from zerohop.engine.base.errors import InvalidRequestError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # both APIs' rule for tool names


@dataclass(slots=True, frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})
    strict: bool = False
    # A raw-input tool's grammar (tools/raw_input.py): its `input` must be a sentence of it.
    input_grammar: str | None = None

    def as_function(self) -> dict[str, Any]:
        """The OpenAI function shape chat templates take as `tools` (transformers' too)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


def checked_tools(
    tools: list[Tool], at: str = "tools[{}]", schema_key: str = "parameters"
) -> list[Tool]:
    """Refuse bad names, duplicate names and argument schemas that are not objects or not
    valid JSON schemas. Errors name the tool as `at` (each API's own path style) and its
    schema as `schema_key` (the field the client wrote it in)."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        at_i = at.format(i)
        _check_tool(tool, at_i, f"{at_i}.{schema_key}", seen)
    return tools


def _check_tool(tool: Tool, at: str, schema_at: str, seen: set[str]) -> None:
    """One tool's checks (`seen`: the names before it)."""
    if not isinstance(tool.name, str) or not _NAME.match(tool.name):
        raise InvalidRequestError(
            f"{at}.name: {tool.name!r} must be 1 to 64 letters, digits, '_' or '-'"
        )
    if tool.name in seen:
        raise InvalidRequestError(f"{at}.name: the tool name {tool.name!r} is used twice")
    seen.add(tool.name)
    if not isinstance(tool.parameters, dict):
        raise InvalidRequestError(f"{at}: the argument schema must be a JSON object")
    kind = tool.parameters.get("type", "object")
    if kind != "object":
        raise InvalidRequestError(f"{at}: the argument schema's type must be 'object'")
    try:
        schema_validator(tool.parameters)
    except jsonschema.SchemaError as exc:
        where = exc.json_path.removeprefix("$")
        raise InvalidRequestError(
            f"{schema_at}: not a valid JSON schema: {exc.message} (at {where or 'its root'})"
        ) from None


def schema_validator(schema: dict[str, Any]) -> Validator:
    """The validator of `schema` (its draft told by `$schema`, else the latest), which
    raises jsonschema.SchemaError when `schema` is not a valid JSON schema."""
    return _validator(json.dumps(schema, sort_keys=True))


# Clients send the same few tool lists with every request: checking a schema and building
# its validator is done once per distinct schema (a refused one is not kept: exceptions are
# not cached).
@functools.lru_cache(maxsize=512)
def _validator(schema_json: str) -> Validator:
    schema = json.loads(schema_json)
    kind = validator_for(schema)
    kind.check_schema(schema)
    return kind(schema)


class ToolSet(Mapping[str, Tool]):
    """The tools a parser may read calls of, by name, each with its argument validator.

    Parsers also take a plain set of names (then only the name and the arguments being an
    object are checked), which is what surfaces that do not validate pass."""

    def __init__(self, tools: list[Tool]) -> None:
        self._tools = {t.name: t for t in tools}
        self._validators = {t.name: schema_validator(t.parameters) for t in tools}

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tools)

    def __len__(self) -> int:
        return len(self._tools)

    def valid(self, name: str, arguments: dict[str, Any]) -> bool:
        """Whether `arguments` follow the schema of the tool `name`. A schema whose `$ref`
        cannot be resolved (remote documents are never fetched) validates nothing."""
        try:
            valid = self._validators[name].is_valid(arguments)
        except referencing.exceptions.Unresolvable:
            return False
        grammar = self._tools[name].input_grammar
        return valid and (grammar is None or input_matches(grammar, arguments["input"]))


@dataclass(slots=True)
class ToolCall:
    """A call the model made: its tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]
