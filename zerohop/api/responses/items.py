"""Responses `input` items (and the items a previous response kept) as conversation turns.

What the surface decides:
- A string input is one user message. `instructions` is the leading system turn; developer
  and system messages are system turns at their place, which they keep whatever the chat
  template (one it renders no later system turn in is a user-side note there:
  conversation/system_turns.py).
- A message's content is a string or parts; text parts (`input_text`, `output_text`,
  `text`, `refusal`) are joined as they are. Image, file and audio parts are a 400 naming
  the part: the model takes text only.
- `function_call` and `custom_tool_call` items are the calls of the assistant turn they
  follow (a run of them, and the assistant message before them, make one turn); a custom
  call's raw input is the `input` argument the model knows it by (tools/raw_input.py). The
  call's tool is named as the request's tools name it (a namespaced one by its namespace).
- `function_call_output` and `custom_tool_call_output` items answer an earlier call by its
  `call_id` (an unknown one is a 400, as on Chat Completions); an output given as parts is
  their text.
- `reasoning` items are the thought of the assistant turn after them (their `content`, else
  their `summary`), taken as sent: the thoughts of the current tool loop reach the chat
  template, as on every surface that carries thoughts; earlier turns' are not rendered (as
  Qwen3-style templates leave them out). `encrypted_content` is accepted unread.
- Items of hosted tools (`web_search_call`, `local_shell_call`, `tool_search_call`, ...),
  `item_reference` and item types this server does not know are left out of the prompt.
"""

from __future__ import annotations

from typing import Any

from zerohop.api.conversation.request import CallTurn, Role, Turn, call_arguments
from zerohop.api.conversation.system_turns import append_turn
from zerohop.api.errors import ApiError
from zerohop.api.responses.tools import RequestTools
from zerohop.api.tools.raw_input import INPUT

ROLES: dict[str, Role] = {
    "user": "user",
    "assistant": "assistant",
    "system": "system",
    "developer": "system",
}
TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")
CALLS = ("function_call", "custom_tool_call")
OUTPUTS = ("function_call_output", "custom_tool_call_output")


def as_items(given: str | list[Any] | None) -> list[Any]:
    """The request's `input` as a list of items."""
    if given is None:
        return []
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    return given


def input_turns(items: list[Any], instructions: str | None, tools: RequestTools) -> list[Turn]:
    """The turns of `items`, after `instructions` (system turns keep their place, rendered
    as the template allows: conversation/system_turns.py)."""
    turns: list[Turn] = [Turn("system", instructions)] if instructions else []
    calls: dict[str, str] = {}  # call_id -> the model's name of its tool
    thought: str | None = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where}: an input item must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":
            thought = _reasoning_text(item)
            continue
        turn = _turn(kind, item, where, tools, calls)
        if turn is None:
            continue
        if turn.role == "assistant" and thought is not None:
            turn.thought, thought = thought, None
        append_turn(turns, turn)
    if not turns:  # system or developer text alone is a prompt (Codex's warm-up sends one)
        raise ApiError(400, "input: at least one message is required", param="input")
    return turns


def _turn(
    kind: Any, item: dict[str, Any], where: str, tools: RequestTools, calls: dict[str, str]
) -> Turn | None:
    if kind == "message":
        return _message(item, where)
    if kind in CALLS:
        return Turn("assistant", calls=[_call(kind, item, where, tools, calls)])
    if kind in OUTPUTS:
        return _output(item, where, calls)
    return None  # hosted tools' items, item references, types this server does not know


def _message(item: dict[str, Any], where: str) -> Turn | None:
    role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise ApiError(
            400,
            f"{where}.role: must be one of user, assistant, system or developer",
            param=f"{where}.role",
        )
    text = content_text(item.get("content"), f"{where}.content")
    if role == "system" and not text:
        return None
    return Turn(role, text)


def content_text(content: Any, where: str) -> str:
    """A message's (or a call output's) text: a string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: must be a string or a list of parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise ApiError(
                400,
                f"{where}[{j}]: {kind} parts are not supported: this model takes text only",
                param=f"{where}[{j}]",
            )
        if kind in TEXT_PARTS:
            text = part.get("text", part.get("refusal"))
            if isinstance(text, str):
                texts.append(text)
    return "".join(texts)


def _call(
    kind: str, item: dict[str, Any], where: str, tools: RequestTools, calls: dict[str, str]
) -> CallTurn:
    name = item.get("name")
    if not isinstance(name, str):
        raise ApiError(400, f"Missing required parameter: '{where}.name'.", param=where)
    known = tools.model_name(name, item.get("namespace"))
    if isinstance(item.get("call_id"), str):
        calls[item["call_id"]] = known
    if kind == "custom_tool_call":
        raw = item.get("input")
        return CallTurn(known, {INPUT: raw if isinstance(raw, str) else ""})
    return CallTurn(known, call_arguments(item.get("arguments")))


def _output(item: dict[str, Any], where: str, calls: dict[str, str]) -> Turn:
    call_id = item.get("call_id")
    name = calls.get(call_id) if isinstance(call_id, str) else None
    if name is None:
        raise ApiError(
            400,
            f"{where}.call_id: no function_call or custom_tool_call before it has the call_id"
            f" {call_id!r}",
            param=f"{where}.call_id",
        )
    output = item.get("output")
    text = output if isinstance(output, str) else content_text(output, f"{where}.output")
    return Turn("tool", text, tool_name=name)


def _reasoning_text(item: dict[str, Any]) -> str:
    parts = item.get("content") or item.get("summary") or []
    return content_text(parts, "reasoning") if isinstance(parts, list) else ""
