"""A Chat Completions request as the neutral conversation (api/conversation/request.py).

What the surface decides: the messages as turns (an assistant's `tool_calls`, their
arguments JSON objects or, where not, their text as it came; a tool message's result, which
must answer an earlier call's id, as the tool's turn), the tools and the tool choice
(tools.py), the output format (output_format.py, named "response_format or
structured_outputs" in errors), vLLM's `thinking_token_budget` and `chat_template_kwargs`,
and an assistant message's thought (`reasoning` or `reasoning_content`, as vLLM reads them:
Chat has no signatures, so a thought is taken as sent), which reaches the chat template when
the turn is of the current tool loop, as on every surface that carries thoughts.
What the planner decides from them: the prompt, the grammar, whether a thought is split off,
how calls are read.
"""

from __future__ import annotations

from typing import Any

from zerohop.api.conversation.request import (
    CallTurn,
    Conversation,
    Reasoning,
    Turn,
    call_arguments,
)
from zerohop.api.errors import ApiError
from zerohop.api.openai.output_format import chat_grammar
from zerohop.api.openai.schema import ChatRequest, Message, message_text
from zerohop.api.openai.tools import request_tools, tool_choice

OUTPUT_FIELD = "response_format or structured_outputs"


def conversation(request: ChatRequest, template_kwargs: dict[str, Any]) -> Conversation:
    """The request's conversation (tool turns and tools checked as they are mapped)."""
    turns = request_turns(request)
    tools = request_tools(request.tools)
    choice = tool_choice(request)
    budget = Reasoning(None, request.thinking_token_budget, "thinking_token_budget")
    return Conversation(
        turns,
        tools=[] if choice.mode == "none" else tools,  # none offers no tools
        tool_choice=choice,
        output_grammar=chat_grammar(request),
        output_field=OUTPUT_FIELD,
        output_is_answer=request.structured_outputs is None,
        reasoning=budget,
        template_kwargs=template_kwargs,
        render_thoughts=True,
    )


def request_turns(request: ChatRequest) -> list[Turn]:
    if not request.messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    names: dict[str, str] = {}  # call id -> tool name, from the earlier assistant turns
    return [_turn(i, m, names) for i, m in enumerate(request.messages)]


def _turn(index: int, message: Message, names: dict[str, str]) -> Turn:
    if message.role == "tool":
        return _tool_result(index, message, names)
    if message.role != "assistant":
        return Turn(*message_text(index, message))
    thought = message.reasoning or message.reasoning_content or None
    if not message.tool_calls:
        return Turn(*message_text(index, message), thought=thought)
    role, text = message_text(index, _without_calls(message))
    where = f"messages[{index}].tool_calls"
    calls = [_call(f"{where}[{j}]", c, names) for j, c in enumerate(message.tool_calls)]
    return Turn(role, text, calls, thought=thought)


def _without_calls(message: Message) -> Message:
    return Message(role=message.role, content=message.content, name=message.name)


def _call(where: str, call: Any, names: dict[str, str]) -> CallTurn:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, f"{where}.function.name is required", param=where)
    if isinstance(call.get("id"), str):
        names[call["id"]] = function["name"]
    return CallTurn(function["name"], call_arguments(function.get("arguments")))


def _tool_result(index: int, message: Message, names: dict[str, str]) -> Turn:
    where = f"messages[{index}]"
    name = names.get(message.tool_call_id or "")
    if name is None:
        raise ApiError(
            400,
            f"{where}.tool_call_id: {message.tool_call_id!r} answers no earlier tool call",
            param=f"{where}.tool_call_id",
        )
    _, text = message_text(index, Message(role="user", content=message.content))
    return Turn("tool", text, tool_name=name)
