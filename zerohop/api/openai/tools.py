"""Tools on the OpenAI Chat Completions surface: `tools`, `tool_choice` and
`parallel_tool_calls` as the neutral conversation's (api/conversation/request.py).

What the surface decides: each tool's shape (type "function", its name, description,
parameters, strict) and the choice's ("none", "auto", "required" or a named function;
`parallel_tool_calls: false` asks for the first call only). What the planner decides: that
"none" parses nothing (turns.py offers no tools with it, as before tools), that auto parses
calls validated against their tool's schema (an invalid one is content), that a forced
choice writes exactly one call by its grammar, and which tool a name must match.
"""

from __future__ import annotations

from typing import Any

from zerohop.api.conversation.request import ToolChoice
from zerohop.api.errors import ApiError
from zerohop.api.openai.schema import ChatRequest
from zerohop.api.tools.spec import Tool, checked_tools
from zerohop.engine.base.errors import InvalidRequestError


def tool_choice(request: ChatRequest) -> ToolChoice:
    """`tool_choice` (with `parallel_tool_calls`) as the neutral choice."""
    choice, parallel = request.tool_choice, request.parallel_tool_calls is not False
    if choice in (None, "auto", "none", "required"):
        return ToolChoice(choice or "auto", None, parallel)
    return ToolChoice("named", _named(choice), parallel)


def request_tools(given: list[Any] | None) -> list[Tool]:
    tools = [_tool(i, t) for i, t in enumerate(given or [])]
    try:
        return checked_tools(tools, schema_key="function.parameters")
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param="tools") from exc


def _tool(index: int, given: Any) -> Tool:
    where = f"tools[{index}]"
    if not isinstance(given, dict) or given.get("type") != "function":
        raise ApiError(400, f"{where}.type: only 'function' tools are supported", param="tools")
    function = given.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, f"{where}.function.name is required", param="tools")
    parameters = function.get("parameters")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise ApiError(400, f"{where}.function.description must be a string", param="tools")
    return Tool(
        name=function["name"],
        description=description,
        parameters={"type": "object"} if parameters is None else parameters,
        strict=bool(function.get("strict")),
    )


def _named(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function":
        name = None
    if not isinstance(name, str):
        raise ApiError(
            400,
            "tool_choice: must be 'none', 'auto', 'required' or"
            " {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    return name
