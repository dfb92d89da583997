"""The grammar of a forced tool call (`tool_choice` any / required / a named tool): the
model writes exactly one call in the Hermes format, `<tool_call>` + a JSON object with the
tool's name and arguments that follow its schema + `</tool_call>`, so even a small model
produces a valid call every time."""

from __future__ import annotations

import json

from zerohop.api.tools.spec import Tool
from zerohop.engine.structured import grammar as g

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def forced_call_grammar(tools: list[Tool]) -> str:
    """One call of one of `tools` (a single tool: that one)."""
    calls = [_call_schema(tool) for tool in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    body = json.dumps(g.closed_schema(schema) | {"x-guidance": g.JSON_OPTIONS})
    lark = f'start: "{_lark(OPEN)}\\n" call "\\n{_lark(CLOSE)}"\ncall: %json {body}\n'
    return g.lark_grammar(lark)


def _call_schema(tool: Tool) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _lark(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')
