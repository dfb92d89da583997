"""Output constraints of OpenAI requests as llguidance grammars (engine/structured/grammar.py).

Chat takes OpenAI's `response_format` (`text`, `json_object`, or `json_schema` with a
required `name` and an optional `schema`: absent, any JSON object) or vLLM's
`structured_outputs` (exactly one of json, regex, choice, grammar, json_object); completions
take `structured_outputs`. Both at once is a 400, as is a constraint the backend cannot
compile (the message says why; `param` is `response_format` or `structured_outputs`); a
malformed `response_format` is refused in OpenAI's words, `param` its dotted path.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from zerohop.api.errors import ApiError
from zerohop.api.openai.schema import ChatRequest, CompletionRequest, StructuredOutputs
from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.structured import grammar as g

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def chat_grammar(request: ChatRequest) -> str | None:
    """The grammar a chat request's output must match, or None."""
    if request.response_format is not None and request.structured_outputs is not None:
        raise ApiError(
            400,
            "response_format and structured_outputs cannot be used together; send one",
            param="structured_outputs",
        )
    if request.structured_outputs is not None:
        return structured_outputs_grammar(request.structured_outputs)
    return response_format_grammar(request.response_format)


def completion_grammar(request: CompletionRequest) -> str | None:
    """The grammar a completion's output must match, or None."""
    if request.structured_outputs is None:
        return None
    return structured_outputs_grammar(request.structured_outputs)


def structured_outputs_grammar(so: StructuredOutputs) -> str:
    """vLLM's `structured_outputs`: exactly one constraint."""
    given = [kind for kind in _KINDS if getattr(so, kind) not in (None, False)]
    if len(given) != 1:
        found = ", ".join(given) if given else "none"
        raise ApiError(
            400,
            "structured_outputs: exactly one of json, regex, choice, grammar or json_object"
            f" is required (found {found})",
            param="structured_outputs",
        )
    kind = given[0]
    build = functools.partial(constraint_grammar, kind, getattr(so, kind))
    return _compiled(build, f"structured_outputs.{kind}", "structured_outputs")


def constraint_grammar(kind: str, value: Any) -> str:
    """The grammar of one constraint: `json` (a schema or its JSON text), `regex`, `choice`
    (a list of strings), `grammar` (Lark or GBNF) or `json_object`; InvalidRequestError when
    it cannot compile."""
    if kind == "json":
        return g.json_schema_grammar(value)
    if kind == "regex":
        return g.regex_grammar(value)
    if kind == "choice":
        return g.choice_grammar(value)
    if kind == "grammar":
        return g.lark_grammar(value)
    if kind == "json_object":
        return g.json_object_grammar()
    raise InvalidRequestError(f"unknown constraint kind {kind!r}")


def response_format_grammar(fmt: dict[str, Any] | None) -> str | None:
    """OpenAI's `response_format`; None for `text`."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind is None:
        raise _missing("response_format.type")
    _only_keys(fmt, {"type", "json_schema"} if kind == "json_schema" else {"type"})
    if kind == "text":
        return None
    if kind == "json_object":
        return _compiled(g.json_object_grammar, "response_format", "response_format")
    if kind == "json_schema":
        return _json_schema_format(fmt.get("json_schema"))
    raise ApiError(
        400,
        f"response_format.type: {kind!r} is not supported; use 'text', 'json_object' or"
        " 'json_schema'",
        param="response_format",
    )


def _json_schema_format(spec: Any) -> str:
    where = "response_format.json_schema"
    if spec is None:
        raise _missing(where)
    if not isinstance(spec, dict):
        raise _invalid(where, "must be an object with a name and a schema")
    _only_keys(spec, _JSON_SCHEMA_KEYS, where)
    name = spec.get("name")
    if name is None:
        raise _missing(f"{where}.name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _invalid(f"{where}.name", "must be 1 to 64 letters, digits, '_' or '-'")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise _invalid(f"{where}.strict", "must be a boolean")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise _invalid(f"{where}.description", "must be a string")
    schema = spec.get("schema")
    if schema is None:
        return _compiled(g.json_object_grammar, where, "response_format")
    if not isinstance(schema, dict):
        raise _invalid(f"{where}.schema", "must be a JSON schema object")
    return _compiled(lambda: g.json_schema_grammar(schema), f"{where}.schema", "response_format")


def _compiled(build: Callable[[], str], where: str, param: str) -> str:
    try:
        return build()
    except InvalidRequestError as exc:
        raise ApiError(400, f"{where}: {exc}", param=param) from None


def _only_keys(value: dict[str, Any], allowed: set[str], where: str = "response_format") -> None:
    for key in value:
        if key not in allowed:
            name = f"{where}.{key}"
            raise ApiError(400, f"Unrecognized request argument supplied: {name}", param=name)


def _missing(name: str) -> ApiError:
    return ApiError(400, f"Missing required parameter: '{name}'.", param=name)


def _invalid(name: str, problem: str) -> ApiError:
    return ApiError(400, f"Invalid value for '{name}': {problem}", param=name)
