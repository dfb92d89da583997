"""zerohop's grammars as vLLM's guidance backend takes them.

zerohop compiles every output constraint (JSON schema, regex, choice, Lark/GBNF, tool calls,
a tool call or else an output format) to one llguidance grammar: a JSON `TopLevelGrammar`
whose first grammar is the start and whose Lark rules may name the others (`@name`). vLLM's
guidance backend accepts a Lark grammar (`StructuredOutputsParams.grammar`), so the same
grammar is written as one Lark text: a JSON schema becomes `%json {...}`, a nested Lark
grammar `%lark { ... }`, and each `@name` a rule of the grammar it names. llguidance compiles
the two forms to the same matcher.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from zerohop.engine.base.errors import InvalidRequestError

_REFERENCE = re.compile(r"@([A-Za-z_][A-Za-z0-9_]*)")
_CACHE_SIZE = 512


@functools.lru_cache(maxsize=_CACHE_SIZE)
def as_lark(grammar: str) -> str:
    """The llguidance grammar `grammar` (JSON, or already Lark) as one Lark grammar."""
    if not grammar.lstrip().startswith("{"):
        return grammar  # llguidance writes a Lark grammar's definition as the Lark text
    try:
        parts: list[dict[str, Any]] = json.loads(grammar)["grammars"]
    except (ValueError, KeyError, TypeError):
        raise InvalidRequestError("the constraint is not an llguidance grammar") from None
    by_name = {str(part.get("name")): part for part in parts}
    return _lark_of(parts[0], by_name, seen=())


def _lark_of(part: dict[str, Any], by_name: dict[str, Any], seen: tuple[str, ...]) -> str:
    """A whole Lark grammar (with `start`) for one grammar of the set."""
    if part.get("lark_grammar") is not None:
        return _resolved(part["lark_grammar"], by_name, seen)
    if part.get("json_schema") is not None:
        return f"start: {_json_item(part['json_schema'])}"
    raise InvalidRequestError("the constraint has a grammar of a kind the vLLM engine cannot take")


def _resolved(lark: str, by_name: dict[str, Any], seen: tuple[str, ...]) -> str:
    """`lark` with each `@name` replaced by a rule that holds the grammar it names."""
    rules: list[str] = []
    for name in dict.fromkeys(_REFERENCE.findall(lark)):
        if name in seen or name not in by_name:
            raise InvalidRequestError(f"the constraint's grammar @{name} cannot be resolved")
        rules.append(f"zh__{name}: {_item(by_name[name], by_name, (*seen, name))}")
    body = _REFERENCE.sub(lambda m: f"zh__{m.group(1)}", lark)
    return "\n".join([body, *rules])


def _item(part: dict[str, Any], by_name: dict[str, Any], seen: tuple[str, ...]) -> str:
    if part.get("json_schema") is not None:
        return _json_item(part["json_schema"])
    return "%lark {\n" + _lark_of(part, by_name, seen) + "\n}"


def _json_item(schema: Any) -> str:
    return "%json " + json.dumps(schema)
