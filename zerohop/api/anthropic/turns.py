"""A Messages request as the neutral conversation (api/conversation/request.py).

Decisions where the API leaves room:
- Text blocks of one message are concatenated as they are (blocks are often split only to
  place cache breakpoints); consecutive same-role turns are joined with a blank line.
- A final assistant message without tool_use is a prefill; as in the API it may not end
  with whitespace.
- A `tool_result` with `is_error` reaches the model as "Error: " + its content; each must
  answer a tool_use of an earlier turn. tool_use / tool_result blocks need `tools`.
- `tool_choice` none keeps the tools in the prompt and parses no call; any / tool force one
  call; `disable_parallel_tool_use` keeps the first call only.
- `thinking`: `enabled` (with its budget, >= 1024 and < max_tokens, checked on every model),
  `adaptive` or `between_tools` think, `disabled` or none do not. On a model without a
  reasoning format every kind is accepted and answered without a thought (Claude Code sends
  `enabled` by default; the API lets a model think "if it must", and this one cannot), and
  the checks that exist because of a thought (no prefill, no token-id failover) are skipped.
  A `thinking` block in an assistant turn reaches the prompt only when its signature
  verifies (serving/thought_signatures.py: signed by this deployment for this model and
  tenant); one that does not is left out, or a 400 with --strict-thought-signatures. A
  verified thought is the turn's `reasoning_content` for the chat template when the turn is
  of the current tool loop (after the last user message; planner.py), as Qwen3's template
  renders those; earlier turns' thoughts are left out, as it leaves them out.
  `redacted_thinking` blocks (Anthropic's encrypted thoughts) are accepted and left out.
- `role: "system"` messages (the mid-conversation-system beta) take text blocks only and
  become a system turn at their point, joined to a system turn just before them (the
  request's `system` included). They keep that place: where the chat template renders no
  system turn there, the planner renders it as a `<system-reminder>` note on the user side
  at that point (conversation/system_turns.py), never in the leading system prompt, so the
  prompt's prefix stays the same turn after turn. Text blocks of a user turn (Claude Code's
  `<system-reminder>` blocks after a tool result among them) are user text at their place.
- A system text block (in `system` or a system message) whose text starts with
  `x-anthropic-billing-header:` is left out of the prompt, count_tokens included: Claude
  Code's first block, it changes with each conversation's first message and would make the
  prompt's prefix differ between conversations, defeating prefix caching.
- Image, document, search_result, tool_reference and browser_state blocks, in a message or
  in a tool_result's content, are a 400 naming the block: the model takes text only. A
  server tool's blocks (server_tool_use and its *_tool_result, container_upload), from a
  conversation begun on Anthropic's API, are accepted and left out of the prompt: this
  server runs no server tools.
"""

from __future__ import annotations

from typing import Any

from zerohop.api.anthropic.schema import (
    ChoiceAny,
    ChoiceNone,
    ChoiceTool,
    CountTokensRequest,
    MediaBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    ServerToolResultBlock,
    ServerToolUseBlock,
    TextBlock,
    ThinkingBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolResultBlock,
    ToolUseBlock,
    UnsupportedBlock,
)
from zerohop.api.conversation.reasoning import has_reasoning_format
from zerohop.api.conversation.request import (
    CallTurn,
    Conversation,
    Reasoning,
    ToolChoice,
    Turn,
)
from zerohop.api.conversation.system_turns import append_turn
from zerohop.api.errors import ApiError
from zerohop.api.serving.thought_signatures import ThoughtSigner
from zerohop.api.tools.spec import Tool, checked_tools
from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.structured.grammar import json_schema_grammar

MIN_BUDGET = 1024
BILLING_HEADER = "x-anthropic-billing-header:"


def conversation(
    request: CountTokensRequest,
    chat_template: str | None,
    signer: ThoughtSigner | None = None,
) -> Conversation:
    """The request's conversation; every check of what it says is made here (a later system
    turn keeps its place: the planner renders it as the template allows). `signer` checks
    its thinking blocks (None: none verifies)."""
    turns, prefill = _turns(request, signer)
    conv = Conversation(turns, prefill, tools=request_tools(request), render_thoughts=True)
    conv.tool_choice = _tool_choice(request)
    conv.reasoning = _reasoning(request, chat_template)
    if isinstance(request, MessagesRequest):
        _check_thinking(request, conv.reasoning)
        conv.output_grammar, conv.output_field = output_format(request, prefill)
    return conv


def request_tools(request: CountTokensRequest) -> list[Tool]:
    """The request's tools, checked: client tools only, valid names and schemas."""
    tools = []
    for i, spec in enumerate(request.tools or []):
        if spec.type != "custom":
            message = (
                f"tools.{i}.type: server tools ({spec.type!r}) are not supported by this server"
            )
            raise ApiError(400, message, param="tools")
        if spec.input_schema is None:
            raise ApiError(400, f"tools.{i}.input_schema: Field required", param="tools")
        tools.append(Tool(spec.name, spec.description or "", spec.input_schema, bool(spec.strict)))
    try:
        return checked_tools(tools, at="tools.{}", schema_key="input_schema")
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param="tools") from None


def _tool_choice(request: CountTokensRequest) -> ToolChoice:
    choice = request.tool_choice
    if choice is None:
        return ToolChoice()
    if isinstance(choice, ChoiceNone):
        return ToolChoice("none")
    parallel = not choice.disable_parallel_tool_use
    if isinstance(choice, ChoiceTool):
        return ToolChoice("named", choice.name, parallel)
    if isinstance(choice, ChoiceAny) and not request.tools:
        raise ApiError(400, "tool_choice: 'any' needs at least one tool", "tool_choice")
    return ToolChoice("required" if isinstance(choice, ChoiceAny) else "auto", None, parallel)


# -- turns ---------------------------------------------------------------------------------


def thought_signatures(request: CountTokensRequest) -> list[str]:
    """The signatures of the request's thinking blocks (the keys they name are read first)."""
    return [
        block.signature
        for message in request.messages
        if not isinstance(message.content, str)
        for block in message.content
        if isinstance(block, ThinkingBlock)
    ]


def _turns(
    request: CountTokensRequest, signer: ThoughtSigner | None = None
) -> tuple[list[Turn], str | None]:
    if not request.messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    system = _system_text(request.system, "system") if request.system is not None else ""
    turns: list[Turn] = [Turn("system", system)] if system else []
    calls: dict[str, str] = {}  # tool_use id -> tool name, of the turns so far
    last = len(request.messages) - 1
    for i, message in enumerate(request.messages):
        blocks = _blocks(message.content)
        _check_content(i, message.role, bool(blocks), last)
        for turn in _message_turns(i, message.role, blocks, calls, bool(request.tools), signer):
            append_turn(turns, turn)
    prefill = None
    if turns and turns[-1].role == "assistant" and not turns[-1].calls:
        prefill = turns.pop().text
        if prefill != prefill.rstrip():
            raise ApiError(
                400, "messages: final assistant content cannot end with trailing whitespace"
            )
    return turns, prefill


def _system_text(content: str | list[Any], at: str) -> str:
    """A system prompt's text: text blocks only, Claude Code's billing header left out."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, TextBlock):
            kind = block.kind if isinstance(block, UnsupportedBlock) else _tag(block)
            raise ApiError(
                400, f"{at}.{j}: system content takes text blocks only, not {kind}", param=at
            )
        if not block.text.startswith(BILLING_HEADER):
            texts.append(block.text)
    return "".join(texts)


def _tag(block: Any) -> str:
    return str(type(block).__struct_config__.tag)


def _message_turns(
    i: int,
    role: str,
    blocks: list[Any],
    calls: dict[str, str],
    has_tools: bool,
    signer: ThoughtSigner | None,
) -> list[Turn]:
    """One message's turns: its text (and calls) and, in a user message, each tool result."""
    if role == "system":
        text = _system_text(blocks, f"messages.{i}.content")
        return [Turn("system", text)] if text else []
    turns = [Turn("assistant" if role == "assistant" else "user")]
    for j, block in enumerate(blocks):
        at = f"messages.{i}.content.{j}"
        if isinstance(block, ToolUseBlock | ToolResultBlock) and not has_tools:
            raise ApiError(
                400, "Requests which include `tool_use` or `tool_result` blocks must define tools."
            )
        if isinstance(block, MediaBlock):
            raise _media_error(block, at)
        if isinstance(block, ServerToolUseBlock | ServerToolResultBlock | RedactedThinkingBlock):
            continue  # left out of the prompt (module docstring)
        if isinstance(block, ThinkingBlock):
            if _verified(block, role, at, signer):
                turns[-1].thought = block.thinking
        elif isinstance(block, ToolUseBlock):
            if role != "assistant":
                raise ApiError(400, f"{at}: tool_use blocks are for assistant turns")
            calls[block.id] = block.name
            turns[-1].calls.append(CallTurn(block.name, block.input))
        elif isinstance(block, ToolResultBlock):
            turns += [_tool_result(block, calls, at), Turn("user")]
        else:
            turns[-1].text += block.text
    return [t for t in turns if t.text or t.calls or t.role == "tool"] or turns[:1]


def _tool_result(block: ToolResultBlock, calls: dict[str, str], at: str) -> Turn:
    name = calls.get(block.tool_use_id)
    if name is None:
        raise ApiError(
            400,
            f"{at}: unexpected `tool_use_id` found in `tool_result` blocks: {block.tool_use_id}."
            " Each `tool_result` block must have a corresponding `tool_use` block before it.",
        )
    for k, part in enumerate([] if isinstance(block.content, str) else block.content or []):
        if isinstance(part, UnsupportedBlock):
            raise _media_error(part, f"{at}.content.{k}")
    content = _join(block.content or "")
    return Turn("tool", "Error: " + content if block.is_error else content, tool_name=name)


def _media_error(block: UnsupportedBlock, at: str) -> ApiError:
    message = f"{at}: {block.kind} blocks are not supported: this model takes text only"
    return ApiError(400, message, param=at)


def _check_content(index: int, role: str, has_content: bool, last: int) -> None:
    """The API's rule: every message has content, but a final assistant one (a prefill)."""
    if not has_content and not (index == last and role == "assistant"):
        raise ApiError(
            400,
            f"messages.{index}: all messages must have non-empty content except for the"
            " optional final assistant message",
        )


def _blocks(content: str | list[Any]) -> list[Any]:
    if isinstance(content, str):
        return [TextBlock(content)] if content else []
    return [b for b in content if not (isinstance(b, TextBlock) and not b.text)]


def _join(content: str | list[Any]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


# -- thinking and output format ------------------------------------------------------------


def _reasoning(request: CountTokensRequest, chat_template: str | None) -> Reasoning:
    """What the request asks of the thought; on a model without a reasoning format, nothing
    (it answers without one: module docstring)."""
    reasoning = has_reasoning_format(chat_template)
    config = request.thinking
    if not reasoning:
        return Reasoning(None)
    if config is None:
        return Reasoning(False)
    budget = config.budget_tokens if isinstance(config, ThinkingEnabled) else None
    return Reasoning(not isinstance(config, ThinkingDisabled), budget)


def _check_thinking(request: MessagesRequest, reasoning: Reasoning) -> None:
    config = request.thinking
    if isinstance(config, ThinkingEnabled):  # the API's rules, whichever the model
        if config.budget_tokens < MIN_BUDGET:
            raise ApiError(400, f"thinking.budget_tokens: must be >= {MIN_BUDGET}")
        if config.budget_tokens >= request.max_tokens:
            raise ApiError(400, "max_tokens: must be greater than thinking.budget_tokens")
    if not reasoning.think:
        return
    if request.messages and request.messages[-1].role == "assistant":
        raise ApiError(400, "thinking: may not be enabled with a prefilled assistant message")


def _verified(block: ThinkingBlock, role: str, at: str, signer: ThoughtSigner | None) -> bool:
    """Whether the thought is rendered: its signature verifies (one that does not is left
    out, or refused when the signer is strict)."""
    if role != "assistant":
        raise ApiError(400, f"{at}: thinking blocks are for assistant turns")
    return signer is not None and signer.verified(block.thinking, block.signature, at)


def output_grammar(request: MessagesRequest) -> str | None:
    """The grammar of the request's output format, or None (its checks included)."""
    return output_format(request, _turns(request)[1])[0]


def output_format(request: MessagesRequest, prefill: str | None) -> tuple[str | None, str]:
    """The grammar of `output_config.format` (or the beta's `output_format`), and its field."""
    config = request.output_config.format if request.output_config is not None else None
    if config is not None and request.output_format is not None:
        raise ApiError(
            400, "output_format: use output_config.format (output_format is deprecated), not both"
        )
    where = "output_format" if request.output_format is not None else "output_config.format"
    output_format = config or request.output_format
    if output_format is None:
        return None, where
    if prefill:
        raise ApiError(
            400, f"{where}: structured outputs cannot continue a prefilled assistant message"
        )
    try:
        return json_schema_grammar(output_format.schema), where
    except InvalidRequestError as exc:
        raise ApiError(400, f"{where}.schema: {exc}") from None
