"""Tool calls on the OpenAI Chat Completions surface: the request's `tools`, `tool_choice`
and tool turns translated to the neutral shapes of zerohop/api/tools, and the model's Hermes
calls back as OpenAI's `tool_calls`, whole (`message_fields`) or streamed (`ToolChatStream`).

`tool_choice` "auto" (the default with tools) offers the tools and parses calls, each
validated against its tool's schema (an invalid one is content); "none" offers none and
parses nothing; "required" or a named function forces exactly one call by grammar (with
`response_format` or `structured_outputs` too: a 400), streamed as it is decoded. When
every tool is `strict` (and calls are read as Hermes), auto mode decodes by a grammar that
lets the model write any text but only valid calls.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from zerohop.api.conversation.reasoning import ReasoningParser
from zerohop.api.errors import ApiError
from zerohop.api.openai.output import LogprobFormatter
from zerohop.api.openai.reasoning import reasoning_fields
from zerohop.api.openai.schema import ChatRequest, Message, _message
from zerohop.api.openai.stream import ChatStream, _index
from zerohop.api.tools.forced import auto_call_grammar, forced_call_grammar
from zerohop.api.tools.forced_stream import ForcedCallParser
from zerohop.api.tools.hermes import HermesParser, Parsed
from zerohop.api.tools.parsers import ParserFactory, parse_whole
from zerohop.api.tools.prompt import render_messages
from zerohop.api.tools.spec import Tool, ToolCall, ToolSet, checked_tools
from zerohop.engine.errors import InvalidRequestError
from zerohop.engine.outputs import RequestDelta

_ALNUM = string.ascii_letters + string.digits


@dataclass(slots=True)
class ToolPlan:
    """What a request's tools mean: those offered, whether to parse calls, a forced grammar."""

    tools: list[Tool]
    parse: bool = False
    grammar: str | None = None
    parser: ParserFactory = HermesParser  # the calls' format (a forced call: Hermes)
    strict: bool = False  # auto mode with only strict tools: calls constrained by grammar
    # The tools to parse (and validate) calls of, or None when calls are not parsed.
    names: ToolSet | None = field(init=False)

    def __post_init__(self) -> None:
        self.names = ToolSet(self.tools) if self.parse else None


def tool_plan(request: ChatRequest, parser: ParserFactory = HermesParser) -> ToolPlan:
    tools = request_tools(request.tools)
    choice = request.tool_choice
    if not tools and choice not in (None, "none", "auto"):  # those two: as before tools
        raise ApiError(400, "tool_choice: forcing a call requires tools", param="tool_choice")
    if not tools or choice == "none":
        return ToolPlan([])
    if choice in (None, "auto"):
        strict = parser is HermesParser and all(t.strict for t in tools)
        return ToolPlan(tools, parse=True, parser=parser, strict=strict)
    forced = tools if choice == "required" else [_named(choice, tools)]
    grammar = forced_call_grammar(forced)
    return ToolPlan(tools, parse=True, grammar=grammar, parser=ForcedCallParser)


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


def _named(choice: Any, tools: list[Tool]) -> Tool:
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name is None:
        raise ApiError(
            400,
            "tool_choice: must be 'none', 'auto', 'required' or"
            " {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    for tool in tools:
        if tool.name == name:
            return tool
    raise ApiError(400, f"tool_choice: no tool named {name!r} in tools", param="tool_choice")


def check_forced(plan: ToolPlan, grammar: str | None) -> str | None:
    """The grammar to decode with: the forced call's, or the response format's, or in auto
    mode with only strict tools (`strict: true`), free text whose calls follow the tools'
    schemas (forced.auto_call_grammar; the response format's wins: no 400, the calls are
    still validated). Only for the Hermes format, the one that grammar writes."""
    if plan.grammar is None:
        if grammar is None and plan.strict:
            return auto_call_grammar(plan.tools)
        return grammar
    if grammar is not None:
        raise ApiError(
            400,
            "tool_choice: forcing a tool call cannot be combined with response_format"
            " or structured_outputs",
            param="tool_choice",
        )
    return plan.grammar


# -- messages ------------------------------------------------------------------------------


def tool_messages(request: ChatRequest) -> list[dict[str, Any]]:
    """The messages in prompt.py's neutral shape (tool calls and results included)."""
    if not request.messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    names: dict[str, str] = {}  # call id -> tool name, from the earlier assistant turns
    return [_neutral(i, m, names) for i, m in enumerate(request.messages)]


def has_tool_turns(request: ChatRequest) -> bool:
    return any(m.role == "tool" or m.tool_calls for m in request.messages)


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


def chat_prompt_messages(
    request: ChatRequest, plan: ToolPlan, template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template variables of a request that has tools or tool turns."""
    return render_messages(tool_messages(request), plan.tools, template)


# -- output --------------------------------------------------------------------------------


def call_id() -> str:
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def openai_call(call: ToolCall) -> dict[str, Any]:
    arguments = json.dumps(call.arguments)
    return {
        "id": call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }


def parse_all(text: str, names: Collection[str], parser: ParserFactory = HermesParser) -> Parsed:
    return parse_whole(text, parser(names))


def message_fields(
    text: str,
    names: Collection[str] | None,
    finish_reason: str | None,
    parser: ParserFactory = HermesParser,
) -> tuple[dict[str, Any], str | None]:
    """A whole answer's message and finish reason, its calls parsed when `names` is set."""
    if names is None:
        return {"role": "assistant", "content": text}, finish_reason
    parsed = parse_all(text, names, parser)
    if not parsed.calls:
        return {"role": "assistant", "content": parsed.text}, finish_reason
    message = {
        "role": "assistant",
        "content": parsed.text or None,
        "tool_calls": [openai_call(c) for c in parsed.calls],
    }
    return message, "tool_calls"


class ToolChatStream(ChatStream):
    """A chat stream whose text goes through a tool-call parser per choice: text streams as
    content; a forced call (forced_stream.py) as it is decoded, a `tool_calls` delta with its
    index, id, type, name and arguments "" once its name is read, then one per piece of its
    arguments' text; every other call once whole and validated, in the same shape (its
    opening, then all its arguments)."""

    def __init__(
        self,
        *args: Any,
        names: Collection[str],
        parser: ParserFactory = HermesParser,
        in_thought: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        n = self.choices.n
        self.parsers = [parser(names) for _ in range(n)]
        # A reasoning model's thought streams as reasoning_content; calls are read after it.
        self.thoughts = (
            None if in_thought is None else [ReasoningParser(in_thought) for _ in range(n)]
        )
        self.calls = [0] * n  # whole calls per choice
        self.open = [False] * n  # a streamed call is under way (index: calls)

    def step(self, formatter: LogprobFormatter, delta: RequestDelta) -> bytes:
        totals = self.choices.add(delta)
        i = delta.index
        text, thought = delta.new_text, b""
        if self.thoughts is not None:
            thinking, text = self.thoughts[i].feed(text, final=delta.finished)
            thought = self._reasoning_delta(i, thinking) if thinking else b""
        parsed = self.parsers[i].feed(text)
        if delta.finished:
            rest = self.parsers[i].finish()
            parsed.text, parsed.calls = parsed.text + rest.text, parsed.calls + rest.calls
        calls = self._streamed(i, parsed) + b"".join(self._call_chunks(i, c) for c in parsed.calls)
        data = thought
        quiet = calls or thought  # the token's output went out in another delta
        if parsed.text or (delta.new_token_ids and (not quiet or self._per_token(delta))):
            data += self.content(formatter, replace(delta, new_text=parsed.text))
        data += calls
        if delta.finished:
            reason = "tool_calls" if self.calls[i] else totals.finish_reason
            stop_reason = orjson.dumps(totals.stop_reason)
            data += self.head + self.finish_choice(i, reason, stop_reason) + b"]" + self.tail
        return data

    def _per_token(self, delta: RequestDelta) -> bool:
        """Whether a token's chunk carries more than its text (logprobs, token ids): it is
        sent even when a tool delta carries the token's output."""
        return delta.new_logprobs is not None or self.token_ids

    def _streamed(self, index: int, parsed: Parsed) -> bytes:
        """The deltas of a call streamed as it is decoded: its opening, its next fragment;
        the call's end (it arrives whole in `parsed.calls`) needs none."""
        data, k = b"", self.calls[index]
        if parsed.opened is not None:
            self.open[index] = True
            function = {"name": parsed.opened, "arguments": ""}
            opening = {"index": k, "id": call_id(), "type": "function", "function": function}
            data += self._tool_delta(index, opening)
        if parsed.fragment and self.open[index]:
            fragment = {"index": k, "function": {"arguments": parsed.fragment}}
            data += self._tool_delta(index, fragment)
        return data

    def _call_chunks(self, index: int, call: ToolCall) -> bytes:
        k, self.calls[index] = self.calls[index], self.calls[index] + 1
        if self.open[index]:  # streamed already: this is its end
            self.open[index] = False
            return b""
        whole = openai_call(call)
        opening = {**whole, "index": k, "function": {"name": call.name, "arguments": ""}}
        arguments = {"index": k, "function": {"arguments": whole["function"]["arguments"]}}
        return self._tool_delta(index, opening) + self._tool_delta(index, arguments)

    def _tool_delta(self, index: int, call: dict[str, Any]) -> bytes:
        return self._delta(index, {"tool_calls": [call]})

    def _reasoning_delta(self, index: int, thought: str) -> bytes:
        return self._delta(index, reasoning_fields(thought))

    def _delta(self, index: int, fields: dict[str, Any]) -> bytes:
        delta = orjson.dumps(fields)
        return (
            self.head + _index(index) + b',"delta":' + delta
            + b',"logprobs":null,"finish_reason":null}]' + self.tail
        )  # fmt: skip
