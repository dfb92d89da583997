"""A `messages` request as the neutral conversation (api/conversation), and the model's calls
back as GenerateResponse `tool_calls`.

The planner decides what tools, choice and constraint mean, as on the other surfaces: mode
auto parses the calls in the server's tool-call format (only `strict` tools: constrained to
valid calls); required or a named tool forces exactly one call, streamed as it is decoded
(`tool_call_deltas`); none offers no tools; `parallel_tool_calls: false` keeps the first
call. An auto-mode call whose arguments the tool's schema refuses comes back as text.

A client sends the conversation back as ChatMessages: an assistant turn with the
`tool_calls` (and the `thought`) it was given, then a "tool" message per result naming the
call's `tool_call_id`; the current tool loop's thoughts reach the chat template, taken as
sent (gRPC has no signatures), as on every surface that carries thoughts. They become
neutral turns here, checked where they enter (the arguments a JSON object, each result
answering an earlier call), as the OpenAI surface checks its own.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Sequence
from typing import Any, cast

from zerohop.api.conversation.request import CallTurn, Conversation, Role, ToolChoice, Turn
from zerohop.api.errors import ApiError
from zerohop.api.tools.spec import Tool, ToolCall, checked_tools
from zerohop.engine.base.errors import InvalidRequestError
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb

_ALNUM = string.ascii_letters + string.digits

Request = pb.GenerateRequest | pb.CountTokensRequest


def conversation(request: Request, output_grammar: str | None = None) -> Conversation:
    """A `messages` request as the neutral conversation; `output_grammar`: its constraint's."""
    turns = chat_turns(request.messages.messages)
    if not turns:
        raise ApiError(400, "messages: at least one message is required", "messages")
    tools, choice = _tools(request), _choice(request)
    return Conversation(
        turns,
        tools=[] if choice.mode == "none" else tools,  # none: the tools are not offered
        tool_choice=choice,
        output_grammar=output_grammar,
        output_field="constraint",
        output_is_answer=False,
        render_thoughts=True,  # the current tool loop's (ChatMessage.thought)
    )


def refuse_tools(request: Request) -> None:
    """A `prompt` or `prompt_token_ids` request has no tools to call (no chat template)."""
    if request.tools:
        raise ApiError(400, "tools: tools need a messages prompt", "tools")
    if _choice(request).forced:
        raise ApiError(400, "tool_choice: forcing a call requires tools", "tool_choice")


def _choice(request: Request) -> ToolChoice:
    given = request.tool_choice if request.HasField("tool_choice") else pb.ToolChoice()
    parallel = not given.HasField("parallel_tool_calls") or given.parallel_tool_calls
    if given.mode == pb.TOOL_CHOICE_MODE_NONE:
        if given.HasField("name"):
            raise ApiError(400, "tool_choice: mode none cannot name a tool", "tool_choice")
        return ToolChoice("none", None, parallel)
    if given.HasField("name"):
        return ToolChoice("named", given.name, parallel)
    if given.mode == pb.TOOL_CHOICE_MODE_REQUIRED:
        return ToolChoice("required", None, parallel)
    return ToolChoice("auto", None, parallel)


def _tools(request: Request) -> list[Tool]:
    tools = [_tool(i, t) for i, t in enumerate(request.tools)]
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


def call_id() -> str:
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def tool_call(call: ToolCall, given_id: str | None = None) -> pb.ToolCall:
    """A whole call; `given_id`: the id its streamed deltas carried."""
    arguments = json.dumps(call.arguments)
    return pb.ToolCall(id=given_id or call_id(), name=call.name, arguments_json=arguments)


# -- messages ------------------------------------------------------------------------------


def chat_turns(messages: Sequence[pb.ChatMessage]) -> list[Turn]:
    """The messages as neutral turns; bad calls and results are a 400."""
    names: dict[str, str] = {}  # call id -> tool name, from the earlier assistant turns
    return [_turn(i, m, names) for i, m in enumerate(messages)]


def _turn(index: int, message: pb.ChatMessage, names: dict[str, str]) -> Turn:
    where = f"messages[{index}]"
    if message.role == "tool":
        return Turn("tool", message.content, tool_name=_answered(where, message, names))
    if message.tool_calls and message.role != "assistant":
        text = f"{where}.tool_calls: only assistant messages carry tool calls"
        raise ApiError(400, text, "messages")
    calls = [_call(f"{where}.tool_calls[{j}]", c, names) for j, c in enumerate(message.tool_calls)]
    if message.thought and message.role != "assistant":
        raise ApiError(400, f"{where}.thought: only assistant messages carry a thought", "messages")
    return Turn(cast(Role, message.role), message.content, calls, thought=message.thought or None)


def _call(where: str, call: pb.ToolCall, names: dict[str, str]) -> CallTurn:
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
    return CallTurn(call.name, arguments)


def _answered(where: str, message: pb.ChatMessage, names: dict[str, str]) -> str:
    """The tool a result answers (templates and the fallback show it), found by call id."""
    name = names.get(message.tool_call_id)
    if name is None:
        text = f"{where}.tool_call_id: {message.tool_call_id!r} answers no earlier tool call"
        raise ApiError(400, text, "messages")
    return name
