"""How tools and tool turns reach the model: through its chat template's `tools` variable
when the template uses it (as transformers' `apply_chat_template(tools=...)` passes them),
else through a documented fallback: a system preamble in the Hermes format, assistant calls
written as `<tool_call>` text and tool results as `<tool_response>` user turns.

Messages come in one neutral shape from both surfaces: {"role", "content"} plus, for an
assistant turn, "tool_calls": [ToolCall-like dicts {"name", "arguments"}], and for a tool
result {"role": "tool", "content", "name"}.
"""

from __future__ import annotations

import json
from typing import Any

from zerohop.api.tools.forced import CLOSE, OPEN
from zerohop.api.tools.spec import Tool

PREAMBLE = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_takes_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def render_messages(
    messages: list[dict[str, Any]], tools: list[Tool], template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template variables for a request with `tools`."""
    if template_takes_tools(template):
        return [_templated(m) for m in messages], {"tools": [t.as_function() for t in tools]}
    return _fallback(messages, tools), {}


def _templated(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    functions = [
        {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls
    ]
    return {**message, "tool_calls": functions}


def _fallback(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
    listing = "\n".join(json.dumps(t.as_function()) for t in tools)
    preamble = PREAMBLE.format(tools=listing)
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
            out.append({"role": "user", "content": text})
        elif m.get("tool_calls"):
            calls = "\n".join(call_text(c["name"], c["arguments"]) for c in m["tool_calls"])
            content = (m.get("content") or "") + ("\n" if m.get("content") else "") + calls
            out.append({"role": "assistant", "content": content})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + preamble}
    else:
        out.insert(0, {"role": "system", "content": preamble})
    return out


def call_text(name: str, arguments: dict[str, Any] | str) -> str:
    if isinstance(arguments, str):  # not a JSON object: the text as the model left it
        body = f'{{"name": {json.dumps(name)}, "arguments": {arguments}}}'
    else:
        body = json.dumps({"name": name, "arguments": arguments})
    return f"{OPEN}\n{body}\n{CLOSE}"
