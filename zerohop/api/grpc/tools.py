"""Tools on the gRPC surface: GenerateRequest's `tools` / `tool_choice` to and from
zerohop.api.tools, and the model's calls as GenerateResponse `tool_calls`.

Tools need a `messages` prompt, which becomes the neutral conversation (api/conversation):
the planner decides what tools, choice and constraint mean, as on the other surfaces. Mode
auto parses the calls in the server's tool-call format (only strict tools: constrained to
valid calls); required or a named tool forces exactly one call, streamed as it is decoded
(`tool_call_deltas`); none offers no tools; `parallel_tool_calls: false` keeps the first
call. An auto-mode call whose arguments the tool's schema refuses comes back as text.

A client sends the conversation back as ChatMessages: an assistant turn with the
`tool_calls` it was given, then a "tool" message per result naming the call's
`tool_call_id`. They become prompt.py's neutral turns here, checked where they enter (the
arguments a JSON object, each result answering an earlier call), as the OpenAI surface
checks its own.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Sequence
from typing import Any

from zerohop.api.conversation.request import CallTurn, Conversation, ToolChoice, Turn
from zerohop.api.errors import ApiError
from zerohop.api.tools.spec import Tool, ToolCall, checked_tools
from zerohop.engine.errors import InvalidRequestError
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb

_ALNUM = string.ascii_letters + string.digits


def conversation(request: pb.GenerateRequest | pb.CountTokensRequest) -> Conversation:
    """A `messages` request as the neutral conversation (the planner decides the rest)."""
    messages = chat_messages(request.messages.messages)
    if not messages:
        raise ApiError(400, "messages: at least one message is required", "messages")
    turns = [_turn(m) for m in messages]
    tools = prompt_tools(request) or []
    return Conversation(turns, tools=tools, tool_choice=_neutral_choice(_choice(request), tools))


def _neutral_choice(choice: pb.ToolChoice, tools: list[Tool]) -> ToolChoice:
    parallel = not choice.HasField("parallel_tool_calls") or choice.parallel_tool_calls
    if not tools:
        return ToolChoice("none", None, parallel)
    if choice.HasField("name"):
        return ToolChoice("named", choice.name, parallel)
    if choice.mode == pb.TOOL_CHOICE_MODE_REQUIRED:
        return ToolChoice("required", None, parallel)
    return ToolChoice("auto", None, parallel)


def _turn(message: dict[str, Any]) -> Turn:
    calls = [CallTurn(c["name"], c["arguments"]) for c in message.get("tool_calls") or []]
    return Turn(message["role"], message["content"], calls, message.get("name"))


def prompt_tools(request: pb.GenerateRequest | pb.CountTokensRequest) -> list[Tool] | None:
    """The tools the prompt renders: None without tools, [] with mode none. Generate and
    CountTokens share it, so a count is of the prompt Generate would see and a request
    CountTokens accepts is one Generate accepts (a constraint aside)."""
    tools = checked([_tool(i, t) for i, t in enumerate(request.tools)])
    choice = _choice(request)
    if not tools:
        if _forced(choice):
            raise ApiError(400, "tool_choice: forcing a call requires tools", "tool_choice")
        return None
    if request.WhichOneof("input") != "messages":
        raise ApiError(400, "tools: tools need a messages prompt", "tools")
    if choice.mode == pb.TOOL_CHOICE_MODE_NONE:
        if choice.HasField("name"):
            raise ApiError(400, "tool_choice: mode none cannot name a tool", "tool_choice")
        return []
    _chosen(choice, tools)  # an unknown name is a 400 wherever it is sent
    return tools


def _choice(request: pb.GenerateRequest | pb.CountTokensRequest) -> pb.ToolChoice:
    return request.tool_choice if request.HasField("tool_choice") else pb.ToolChoice()


def _forced(choice: pb.ToolChoice) -> bool:
    return choice.mode == pb.TOOL_CHOICE_MODE_REQUIRED or choice.HasField("name")


def checked(tools: list[Tool]) -> list[Tool]:
    try:
        return checked_tools(tools)
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), "tools") from exc


def _tool(index: int, given: pb.Tool) -> Tool:
    parameters: Any = {"type": "object"}
    if given.parameters_json:
        try:
            parameters = json.loads(given.parameters_json)
        except ValueError:
            message = f"tools[{index}].parameters_json: not JSON"
            raise ApiError(400, message, "tools") from None
    return Tool(given.name, given.description, parameters, strict=given.strict)


def _chosen(choice: pb.ToolChoice, tools: list[Tool]) -> list[Tool]:
    if not choice.HasField("name"):
        return tools
    chosen = [t for t in tools if t.name == choice.name]
    if not chosen:
        message = f"tool_choice.name: no tool named {choice.name!r} in tools"
        raise ApiError(400, message, "tool_choice")
    return chosen


def call_id() -> str:
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def tool_call(call: ToolCall, given_id: str | None = None) -> pb.ToolCall:
    """A whole call; `given_id`: the id its streamed deltas carried."""
    arguments = json.dumps(call.arguments)
    return pb.ToolCall(id=given_id or call_id(), name=call.name, arguments_json=arguments)


# -- messages ------------------------------------------------------------------------------


def chat_messages(messages: Sequence[pb.ChatMessage]) -> list[dict[str, Any]]:
    """The messages in prompt.py's neutral shape; bad calls and results are a 400."""
    names: dict[str, str] = {}  # call id -> tool name, from the earlier assistant turns
    return [_neutral(i, m, names) for i, m in enumerate(messages)]


def _neutral(index: int, message: pb.ChatMessage, names: dict[str, str]) -> dict[str, Any]:
    where = f"messages[{index}]"
    if message.role == "tool":
        return _tool_result(where, message, names)
    if not message.tool_calls:
        return {"role": message.role, "content": message.content}
    if message.role != "assistant":
        message_text = f"{where}.tool_calls: only assistant messages carry tool calls"
        raise ApiError(400, message_text, "messages")
    calls = [_call(f"{where}.tool_calls[{j}]", c, names) for j, c in enumerate(message.tool_calls)]
    return {"role": "assistant", "content": message.content, "tool_calls": calls}


def _call(where: str, call: pb.ToolCall, names: dict[str, str]) -> dict[str, Any]:
    if not call.name:
        raise ApiError(400, f"{where}.name is required", "messages")
    try:
        arguments = json.loads(call.arguments_json or "{}")
    except ValueError:
        raise ApiError(400, f"{where}.arguments_json is not valid JSON", "messages") from None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{where}.arguments_json must be a JSON object", "messages")
    if call.id:
        names[call.id] = call.name
    return {"name": call.name, "arguments": arguments}


def _tool_result(where: str, message: pb.ChatMessage, names: dict[str, str]) -> dict[str, Any]:
    """A tool turn names its tool (templates and the fallback show it), found by call id."""
    name = names.get(message.tool_call_id)
    if name is None:
        text = f"{where}.tool_call_id: {message.tool_call_id!r} answers no earlier tool call"
        raise ApiError(400, text, "messages")
    return {"role": "tool", "content": message.content, "name": name}
