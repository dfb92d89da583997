"""Output constraints as llguidance grammars: a JSON schema, any JSON object, a regex, a
choice of strings or a Lark (or GBNF) grammar, each checked where it enters.

The result is the grammar text `SamplingParams.grammar` carries to the engine (and the key
of its compile cache). A construct the backend cannot compile is an InvalidRequestError
naming it (the surfaces answer 400), never a hang at decode time.

Torch-free, so the API process builds and checks grammars without the model code.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from zerohop.engine.base.errors import InvalidRequestError

# Between JSON tokens: nothing, one space, or a newline and up to 16 spaces of indent. A
# small model cannot loop on whitespace, and pretty-printed JSON still fits.
JSON_WHITESPACE = r"(\n {0,16}| )"
JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": JSON_WHITESPACE}
# Applications send the same few schemas over and over: building and checking one costs
# ~2 ms, a cache hit microseconds (a refused one is not kept: exceptions are not cached).
CACHE_SIZE = 512
# Subschemas keyed by name, and lists of subschemas, where objects may nest.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def json_schema_grammar(schema: Any) -> str:
    """JSON matching `schema`, with strict semantics: an object has only the properties its
    schema names (unless it says `additionalProperties`), and its required ones."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError("a JSON schema must be an object (or true/false)")
    return _schema_grammar(json.dumps(schema))  # key order kept: it orders the output


@functools.lru_cache(maxsize=CACHE_SIZE)
def _schema_grammar(schema_json: str) -> str:
    closed = closed_schema(json.loads(schema_json))
    return _checked(
        lambda: llguidance.LLMatcher.grammar_from_json_schema(closed, defaults=JSON_OPTIONS),
        "JSON schema",
    )


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's JSON mode)."""
    return json_schema_grammar({"type": "object", "additionalProperties": True})


def regex_grammar(pattern: str) -> str:
    if not isinstance(pattern, str) or not pattern:
        raise InvalidRequestError("a regex constraint must be a non-empty string")
    return _regex_grammar(pattern)


@functools.lru_cache(maxsize=CACHE_SIZE)
def _regex_grammar(pattern: str) -> str:
    return _checked(lambda: llguidance.LLMatcher.grammar_from_regex(pattern), "regex")


def choice_grammar(choices: list[str]) -> str:
    """Exactly one of `choices`."""
    if not isinstance(choices, list) or not choices:
        raise InvalidRequestError("a choice constraint needs a non-empty list of strings")
    if not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError("every choice must be a non-empty string")
    return regex_grammar("|".join(f"(?:{re.escape(c)})" for c in choices))


def lark_grammar(text: str) -> str:
    """A Lark grammar (llguidance's dialect), or a GBNF/EBNF one (`root ::= ...`, as
    llama.cpp and xgrammar write them), which is translated to Lark."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequestError("a grammar constraint must be a non-empty string")
    return _lark_grammar(text)


@functools.lru_cache(maxsize=CACHE_SIZE)
def _lark_grammar(text: str) -> str:
    return _checked(lambda: llguidance.LLMatcher.grammar_from_lark(any_to_lark(text)), "grammar")


# In a Lark grammar given to `lark_with_answer`: the start of the other grammar.
ANSWER = "@zerohop_answer"


def lark_with_answer(lark: str, answer: str) -> str:
    """The Lark grammar `lark`, in whose rules `ANSWER` stands for the grammar text `answer`
    (what this module's builders return): for example a tool call or else an output format."""
    return _lark_with_answer(lark, answer)


@functools.lru_cache(maxsize=CACHE_SIZE)
def _lark_with_answer(lark: str, answer: str) -> str:
    parts = json.loads(answer)["grammars"]
    named = {**parts[0], "name": ANSWER.removeprefix("@")}
    main = {"name": "zerohop_main", "json_schema": None, "lark_grammar": lark}
    top = {"grammars": [main, named, *parts[1:]], "max_tokens": None}
    return _checked(lambda: json.dumps(top), "grammar")


def check_grammar(grammar: str) -> None:
    """Raise InvalidRequestError with the backend's reason when `grammar` cannot compile."""
    message = llguidance.LLMatcher.validate_grammar(grammar)
    if message:
        raise InvalidRequestError(f"the constraint cannot be compiled: {_first_line(message)}")


_SOURCE_LINE = re.compile(r"\d+ \| ")


def _checked(build: Callable[[], str], what: str) -> str:
    try:
        grammar = build()
    except (ValueError, TypeError, RuntimeError) as exc:
        raise InvalidRequestError(f"the {what} cannot be compiled: {_first_line(exc)}") from None
    message = llguidance.LLMatcher.validate_grammar(grammar)
    if message:
        raise InvalidRequestError(f"the {what} cannot be compiled: {_first_line(message)}")
    return grammar


def _first_line(message: object) -> str:
    """The backend's reason, without the grammar source lines it quotes ("2 | call: ...")."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    lines = [line for line in lines if not _SOURCE_LINE.match(line) and line != "^"]
    return "; ".join(lines[:3]) if lines else "rejected by the grammar backend"


def closed_schema(schema: Any) -> Any:
    """A copy of `schema` whose objects allow no properties beyond those they name."""
    if not isinstance(schema, dict):
        return schema
    out = _merged_all_of(dict(schema))
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(sub) for sub in out[key]]
    for key in _SCHEMA_ONES:
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key])
    return out


def _merged_all_of(schema: dict[str, Any]) -> dict[str, Any]:
    """`allOf` branches that are all plain objects merged into one object (their properties
    and required names together), so that closing it closes the whole: closing each branch
    alone would let no object through (each refuses the other's properties)."""
    branches = schema.get("allOf")
    if not isinstance(branches, list) or not branches or not all(map(_plain_object, branches)):
        return schema
    merged = {k: v for k, v in schema.items() if k != "allOf"}
    properties = dict(merged.get("properties") or {})
    required = list(merged.get("required") or [])
    for branch in branches:
        for name, sub in (branch.get("properties") or {}).items():
            # a name two branches both describe must meet both descriptions
            properties[name] = {"allOf": [properties[name], sub]} if name in properties else sub
        required += [name for name in branch.get("required") or [] if name not in required]
    merged.update(type="object", properties=properties)
    if required:
        merged["required"] = required
    return merged


def _plain_object(branch: Any) -> bool:
    """An object schema of properties only (no reference, no other constraint to keep)."""
    keys = {"type", "properties", "required", "description", "title"}
    if not isinstance(branch, dict) or branch.get("type", "object") != "object":
        return False
    return "properties" in branch and set(branch) <= keys
