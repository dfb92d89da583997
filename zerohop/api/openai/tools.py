"""Tools on the OpenAI Chat Completions surface: the request's `tools`, `tool_choice`,
`parallel_tool_calls` and tool turns as the neutral conversation's (api/conversation); the
planner decides what they mean, events_stream.py encodes the calls read back.

"none" offers no tools and parses nothing; auto offers them and parses calls (each validated
against its tool's schema: an invalid one is content); "required" or a named function force
exactly one call; `parallel_tool_calls: false` keeps the first call only.
"""

from __future__ import annotations

import json
from typing import Any

from zerohop.api.conversation.request import ToolChoice
from zerohop.api.errors import ApiError
from zerohop.api.openai.schema import ChatRequest, Message, _message
from zerohop.api.tools.spec import Tool, checked_tools
from zerohop.engine.errors import InvalidRequestError


def tool_choice(request: ChatRequest, tools: list[Tool]) -> ToolChoice:
    """`tool_choice` (with `parallel_tool_calls`) as the neutral choice. "none", or no
    tools with auto or none, offers none and parses nothing (as before tools)."""
    choice = request.tool_choice
    if request.parallel_tool_calls not in (None, True, False):
        raise ApiError(400, "parallel_tool_calls: must be a boolean", param="parallel_tool_calls")
    parallel = request.parallel_tool_calls is not False
    if choice in (None, "auto"):
        return ToolChoice("auto", None, parallel)
    if choice == "none":
        return ToolChoice("none", None, parallel)
    if choice == "required":
        return ToolChoice("required", None, parallel)
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
    if not isinstance(choice, dict) or choice.get("type") != "function" or name is None:
        raise ApiError(
            400,
            "tool_choice: must be 'none', 'auto', 'required' or"
            " {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    return name


# -- messages ------------------------------------------------------------------------------


def tool_messages(request: ChatRequest) -> list[dict[str, Any]]:
    """The messages in prompt.py's neutral shape (tool calls and results included)."""
    if not request.messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    names: dict[str, str] = {}  # call id -> tool name, from the earlier assistant turns
    return [_neutral(i, m, names) for i, m in enumerate(request.messages)]


def _neutral(index: int, message: Message, names: dict[str, str]) -> dict[str, Any]:
    where = f"messages[{index}]"
    if message.role == "tool":
        return _tool_result(index, message, names)
    if message.role == "assistant" and message.tool_calls:
        plain = _message(index, _without_calls(message))
        calls = [
            _call(f"{where}.tool_calls[{j}]", c, names) for j, c in enumerate(message.tool_calls)
        ]
        return {**plain, "tool_calls": calls}
    return _message(index, message)


def _without_calls(message: Message) -> Message:
    return Message(role=message.role, content=message.content, name=message.name)


def _call(where: str, call: Any, names: dict[str, str]) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, f"{where}.function.name is required", param=where)
    arguments = function.get("arguments") or "{}"
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise ApiError(400, f"{where}.function.arguments is not valid JSON", param=where) from None
    if not isinstance(parsed, dict):
        raise ApiError(400, f"{where}.function.arguments must be a JSON object", param=where)
    if isinstance(call.get("id"), str):
        names[call["id"]] = function["name"]
    return {"name": function["name"], "arguments": parsed}


def _tool_result(index: int, message: Message, names: dict[str, str]) -> dict[str, Any]:
    where = f"messages[{index}]"
    name = names.get(message.tool_call_id or "")
    if name is None:
        raise ApiError(
            400,
            f"{where}.tool_call_id: {message.tool_call_id!r} answers no earlier tool call",
            param=f"{where}.tool_call_id",
        )
    plain = _message(index, Message(role="user", content=message.content))
    return {"role": "tool", "content": plain["content"], "name": name}
