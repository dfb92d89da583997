"""The grammars of tool calls in the Hermes format, `<tool_call>` + a JSON object with the
tool's name and arguments that follow its schema + `</tool_call>`:

- a forced call (`tool_choice` any / required / a named tool): exactly one call, so even a
  small model produces a valid call every time;
- strict tools in auto mode: free text, in which each `<tool_call>` can only go on as a
  valid call. The text is one lexeme that cannot hold `<tool_call>`, and the text before a
  call another that ends at its first `<tool_call>`: llguidance's lexer is greedy (a text
  lexeme that may hold any prefix of the tag would have eaten `<tool_call` and then had
  nowhere to go), and its `stop=` form would take the tag back (a backtrack the sampler
  cannot do);
- tools with an output format (the answer's grammar): one call (forced) or one or more
  (auto), or else the answer in its format.

In each, a call's JSON object follows call_schema.py (the tool's definitions lifted).
"""

from __future__ import annotations

import json
import re
from typing import Any

from zerohop.api.tools.call_schema import call_schema
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


def call_or_answer_grammar(tools: list[Tool], answer: str, many: bool) -> str:
    """One call of one of `tools` (`many`: one or more, a newline apart), or else the answer
    as the grammar `answer` has it (an output format's)."""
    calls = 'calls: call_block ("\\n" call_block)*\n' if many else "calls: call_block\n"
    lark = (
        f"start: calls | {g.ANSWER}\n{calls}"
        f'call_block: "{_lark(OPEN)}\\n" call "\\n{_lark(CLOSE)}"\n{_call_rule(tools)}'
    )
    return g.lark_with_answer(lark, answer)


def _call_rule(tools: list[Tool]) -> str:
    definitions: dict[str, Any] = {}
    calls = []
    for tool in tools:
        schema, defined = call_schema(tool)
        calls.append(schema)
        definitions.update(defined)
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if definitions:
        schema = {**schema, "$defs": definitions}
    body = json.dumps(g.closed_schema(schema) | {"x-guidance": g.JSON_OPTIONS})
    return f"call: %json {body}\n"


def _lark(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')
