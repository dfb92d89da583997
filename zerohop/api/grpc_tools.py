"""Tools on the gRPC surface: GenerateRequest's `tools` / `tool_choice` to and from
zerohop.api.tools, and the model's calls as GenerateResponse `tool_calls`.

Tools need a `messages` prompt (they reach the model through the chat template or the
Hermes fallback, tools/prompt.py). Mode auto parses the calls in the server's tool-call
format; required or a named tool forces exactly one call by grammar (always Hermes, read as
Hermes); none offers no tools. Arguments of auto-mode calls are not checked against the
tool's schema.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Any

from zerohop.api.errors import ApiError
from zerohop.api.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.api.tools.forced import forced_call_grammar
from zerohop.api.tools.hermes import HermesParser, Parsed
from zerohop.api.tools.parsers import ParserFactory, ToolParser
from zerohop.api.tools.spec import Tool, ToolCall, checked_tools
from zerohop.engine.errors import InvalidRequestError

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
    tools = checked([_tool(i, t) for i, t in enumerate(request.tools)])
    choice = request.tool_choice if request.HasField("tool_choice") else pb.ToolChoice()
    forced = choice.mode == pb.TOOL_CHOICE_MODE_REQUIRED or choice.HasField("name")
    if not tools:
        if forced:
            raise ApiError(400, "tool_choice: forcing a call requires tools", "tool_choice")
        return None
    if request.WhichOneof("input") != "messages":
        raise ApiError(400, "tools: tools need a messages prompt", "tools")
    if choice.mode == pb.TOOL_CHOICE_MODE_NONE:
        if choice.HasField("name"):
            raise ApiError(400, "tool_choice: mode none cannot name a tool", "tool_choice")
        return GrpcTools([])
    names = {t.name for t in tools}
    if not forced:
        return GrpcTools(tools, parser=parser(names))
    if request.HasField("constraint"):
        raise ApiError(400, "tool_choice: a forced call cannot take a constraint", "tool_choice")
    chosen = _chosen(choice, tools)
    return GrpcTools(tools, forced_call_grammar(chosen), HermesParser(names))


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
