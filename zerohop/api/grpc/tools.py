"""Tools on the gRPC surface: GenerateRequest's `tools` / `tool_choice` to and from
zerohop.api.tools, and the model's calls as GenerateResponse `tool_calls`.

Tools need a `messages` prompt (they reach the model through the chat template or the
Hermes fallback, tools/prompt.py). Mode auto parses the calls in the server's tool-call
format; required or a named tool forces exactly one call by grammar (always Hermes, read as
Hermes); none offers no tools. An auto-mode call whose arguments the tool's schema refuses
comes back as text, as on the other surfaces.

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
from dataclasses import dataclass
from typing import Any

from zerohop.api.errors import ApiError
from zerohop.api.tools.forced import forced_call_grammar
from zerohop.api.tools.hermes import HermesParser, Parsed
from zerohop.api.tools.parsers import ParserFactory, ToolParser
from zerohop.api.tools.spec import Tool, ToolCall, ToolSet, checked_tools
from zerohop.engine.errors import InvalidRequestError
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb

_ALNUM = string.ascii_letters + string.digits


@dataclass(slots=True)
class GrpcTools:
    """A request's tools: those offered, the forced call's grammar, and its parser."""

    tools: list[Tool]
    grammar: str | None = None
    parser: ToolParser | None = None  # None: nothing is parsed
    calls: int = 0  # calls read so far

    def feed(self, text: str, final: bool) -> Parsed:
        """The text and calls in the next piece of output."""
        if self.parser is None:
            return Parsed(text=text)
        parsed = self.parser.feed(text)
        if final:
            rest = self.parser.finish()
            parsed = Parsed(parsed.text + rest.text, parsed.calls + rest.calls)
        self.calls += len(parsed.calls)
        return parsed


def grpc_tools(request: pb.GenerateRequest, parser: ParserFactory) -> GrpcTools | None:
    """The request's tools, or None without any; a bad tool or choice is a 400."""
    tools = prompt_tools(request)
    if tools is None:
        return None
    if not tools:  # mode none
        return GrpcTools([])
    names = ToolSet(tools)  # auto-mode calls are validated against their schemas
    choice = _choice(request)
    if not _forced(choice):
        return GrpcTools(tools, parser=parser(names))
    if request.HasField("constraint"):
        raise ApiError(400, "tool_choice: a forced call cannot take a constraint", "tool_choice")
    chosen = _chosen(choice, tools)
    return GrpcTools(tools, forced_call_grammar(chosen), HermesParser(names))


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
    return Tool(name=given.name, description=given.description, parameters=parameters)


def _chosen(choice: pb.ToolChoice, tools: list[Tool]) -> list[Tool]:
    if not choice.HasField("name"):
        return tools
    chosen = [t for t in tools if t.name == choice.name]
    if not chosen:
        message = f"tool_choice.name: no tool named {choice.name!r} in tools"
        raise ApiError(400, message, "tool_choice")
    return chosen


def tool_call(call: ToolCall) -> pb.ToolCall:
    call_id = "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))
    return pb.ToolCall(id=call_id, name=call.name, arguments_json=json.dumps(call.arguments))


# -- messages ------------------------------------------------------------------------------


def chat_messages(messages: Sequence[pb.ChatMessage]) -> list[dict[str, Any]]:
    """The messages in prompt.py's neutral shape; bad calls and results are a 400."""
    names: dict[str, str] = {}  # call id -> tool name, from the earlier assistant turns
    return [_neutral(i, m, names) for i, m in enumerate(messages)]


def has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    """Whether neutral messages need prompt.py's rendering even without tools offered."""
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


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
