"""The grammars of tool calls in the Hermes format, `<tool_call>` + a JSON object with the
tool's name and arguments that follow its schema + `</tool_call>`:

- a forced call (`tool_choice` any / required / a named tool): exactly one call, so even a
  small model produces a valid call every time;
- strict tools in auto mode: free text, in which each `<tool_call>` can only go on as a
  valid call. The text is one lexeme that cannot hold `<tool_call>`, and the text before a
  call another that ends at its first `<tool_call>`: llguidance's lexer is greedy (a text
  lexeme that may hold any prefix of the tag would have eaten `<tool_call` and then had
  nowhere to go), and its `stop=` form would take the tag back (a backtrack the sampler
  cannot do).
"""

from __future__ import annotations

import json
import re

from zerohop.api.tools.spec import Tool
from zerohop.engine.structured import grammar as g

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def forced_call_grammar(tools: list[Tool]) -> str:
    """One call of one of `tools` (a single tool: that one)."""
    lark = f'start: "{_lark(OPEN)}\\n" call "\\n{_lark(CLOSE)}"\n{_call_rule(tools)}'
    return g.lark_grammar(lark)


def auto_call_grammar(tools: list[Tool]) -> str:
    """Any text, with any number of calls of `tools` in it, each valid for its schema."""
    tag = re.escape(OPEN)
    lark = (
        f'start: TEXT | BEFORE_CALL "\\n" call "\\n{_lark(CLOSE)}" start\n'
        f"TEXT: /(?s:.*)/ & ~/(?s:.*{tag}.*)/\n"
        f"BEFORE_CALL: /(?s:.*{tag})/ & ~/(?s:.*{tag}.+)/\n" + _call_rule(tools)
    )
    return g.lark_grammar(lark)


def _call_rule(tools: list[Tool]) -> str:
    calls = [_call_schema(tool) for tool in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    body = json.dumps(g.closed_schema(schema) | {"x-guidance": g.JSON_OPTIONS})
    return f"call: %json {body}\n"


def _call_schema(tool: Tool) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _lark(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')
