"""A Chat Completions request as the neutral conversation (api/conversation/request.py)."""

from __future__ import annotations

from typing import Any

from zerohop.api.conversation.request import CallTurn, Conversation, Reasoning, Turn
from zerohop.api.openai.output_format import chat_grammar
from zerohop.api.openai.schema import ChatRequest
from zerohop.api.openai.tools import request_tools, tool_choice, tool_messages

OUTPUT_FIELD = "response_format or structured_outputs"


def conversation(request: ChatRequest, template_kwargs: dict[str, Any]) -> Conversation:
    """The request's conversation (tool turns and tools checked as they are mapped)."""
    turns = [_turn(m) for m in tool_messages(request)]
    tools = request_tools(request.tools)
    choice = tool_choice(request, tools)
    budget = Reasoning(None, request.thinking_token_budget, "thinking_token_budget")
    return Conversation(
        turns,
        tools=[] if choice.mode == "none" else tools,
        tool_choice=choice,
        output_grammar=chat_grammar(request),
        output_field=OUTPUT_FIELD,
        reasoning=budget,
        template_kwargs=template_kwargs,
    )


def _turn(message: dict[str, Any]) -> Turn:
    calls = [CallTurn(c["name"], c["arguments"]) for c in message.get("tool_calls") or []]
    return Turn(message["role"], message["content"], calls, message.get("name"))
