"""Tool use on the Anthropic Messages surface: its shapes to and from zerohop.api.tools.

Decisions where the API leaves room:
- Tools reach the model through the chat template (or prompt.py's Hermes fallback); the
  model's `<tool_call>` text comes back as `tool_use` blocks, `stop_reason: "tool_use"`.
- `tool_choice` any / tool constrain the output to exactly one call (forced.py); auto lets
  the model write text and calls (validated against their schemas; with only strict tools,
  constrained by grammar to valid ones); none renders the tools but parses no calls.
  `disable_parallel_tool_use` keeps the first call only.
- Content is [a text block, when the text before the first call is not blank] + the calls;
  text after the first call is dropped (as vLLM's Hermes parser does). A response with no
  call holds one text block, possibly empty, as without tools.
- A `tool_result` with `is_error` reaches the model as "Error: " + its content.
- A forced call streams as it is decoded: `content_block_start` once its name is read, an
  `input_json_delta` per piece of its input, `content_block_stop`. Other calls stream once
  whole and valid for their schema (an invalid one is text): the start, one delta, the stop.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
from typing import Any

import orjson

from zerohop.api.anthropic.schema import (
    ChoiceAny,
    ChoiceAuto,
    ChoiceNone,
    ChoiceTool,
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from zerohop.api.errors import ApiError
from zerohop.api.tools.forced import auto_call_grammar, forced_call_grammar
from zerohop.api.tools.forced_stream import ForcedCallParser
from zerohop.api.tools.hermes import HermesParser
from zerohop.api.tools.parsers import ParserFactory, ToolParser
from zerohop.api.tools.spec import Tool, ToolCall, ToolSet, checked_tools
from zerohop.engine.errors import InvalidRequestError

_ID_ALPHABET = string.ascii_letters + string.digits


def uses_tools(request: CountTokensRequest) -> bool:
    """Whether the request defines tools or holds tool blocks (the tool path renders it)."""
    if request.tools:
        return True
    blocks = any(
        isinstance(b, ToolUseBlock | ToolResultBlock)
        for m in request.messages
        if not isinstance(m.content, str)
        for b in m.content
    )
    if blocks:
        raise ApiError(
            400, "Requests which include `tool_use` or `tool_result` blocks must define tools."
        )
    return False


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
        tools.append(Tool(spec.name, spec.description or "", spec.input_schema, spec.strict))
    try:
        return checked_tools(tools, at="tools.{}", schema_key="input_schema")
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param="tools") from None


def forced_grammar(request: MessagesRequest, tools: list[Tool]) -> str | None:
    """The grammar of one call when `tool_choice` is any or a named tool, else None."""
    choice = request.tool_choice
    if isinstance(choice, ChoiceTool):
        chosen = [t for t in tools if t.name == choice.name]
        if not chosen:
            raise ApiError(
                400, f"tool_choice.name: no tool named {choice.name!r} in tools", "tool_choice"
            )
    elif isinstance(choice, ChoiceAny):
        chosen = tools
        if not chosen:
            raise ApiError(400, "tool_choice: 'any' needs at least one tool", "tool_choice")
    else:
        return None
    if request.output_config is not None and request.output_config.format is not None:
        raise ApiError(400, "tool_choice: a forced tool call cannot take output_config.format")
    if request.output_format is not None:
        raise ApiError(400, "tool_choice: a forced tool call cannot take output_format")
    if _prefilled(request):
        raise ApiError(400, "tool_choice: a forced tool call cannot continue a prefill")
    return forced_call_grammar(chosen)


def auto_grammar(
    request: MessagesRequest, tools: list[Tool], parser: ParserFactory, thinks: bool | None
) -> str | None:
    """In auto mode with only strict tools (`strict: true`), the grammar of free text whose
    calls follow the tools' schemas (forced.auto_call_grammar), else None. Not when calls are
    read in another format than Hermes (the one it writes), nor with a grammar of the
    request's own (output_config.format), a prefill or thinking: each is decoded as before,
    its calls validated."""
    choice = request.tool_choice
    if not tools or not all(t.strict for t in tools) or parser is not HermesParser:
        return None
    if choice is not None and not isinstance(choice, ChoiceAuto):
        return None
    formatted = request.output_format is not None or (
        request.output_config is not None and request.output_config.format is not None
    )
    if formatted or thinks or _prefilled(request):
        return None
    return auto_call_grammar(tools)


def _prefilled(request: CountTokensRequest) -> bool:
    last = request.messages[-1] if request.messages else None
    return last is not None and last.role == "assistant" and not _has_calls(last.content)


def neutral_turns(
    request: CountTokensRequest,
) -> tuple[list[dict[str, Any]], str | None]:
    """prompt.py's neutral messages (system first, same-role text merged) and the prefill."""
    if not request.messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    turns: list[dict[str, Any]] = []
    calls: dict[str, str] = {}  # tool_use id -> tool name, of the turns so far
    last = len(request.messages) - 1
    for i, message in enumerate(request.messages):
        blocks = _blocks(message.content)
        check_content(i, message.role, bool(blocks), last)
        if message.role == "assistant":
            _assistant_turn(turns, blocks, calls)
        else:
            _user_turn(turns, blocks, calls, i)
    system = _join(request.system) if request.system is not None else ""
    return with_system_and_prefill(turns, system)


def with_system_and_prefill(
    turns: list[dict[str, Any]], system: str
) -> tuple[list[dict[str, Any]], str | None]:
    """`turns` with the system prompt first, less a final assistant text turn (a prefill,
    returned apart: the answer continues it)."""
    prefill = None
    if turns[-1]["role"] == "assistant" and not turns[-1].get("tool_calls"):
        prefill = turns.pop()["content"]
        if prefill != prefill.rstrip():
            raise ApiError(
                400, "messages: final assistant content cannot end with trailing whitespace"
            )
    if system:
        turns.insert(0, {"role": "system", "content": system})
    return turns, prefill


def check_content(index: int, role: str, has_content: bool, last: int) -> None:
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


def _has_calls(content: str | list[Any]) -> bool:
    return not isinstance(content, str) and any(isinstance(b, ToolUseBlock) for b in content)


def _assistant_turn(turns: list[dict[str, Any]], blocks: list[Any], calls: dict[str, str]) -> None:
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    uses = [b for b in blocks if isinstance(b, ToolUseBlock)]
    calls.update((b.id, b.name) for b in uses)
    if turns and turns[-1]["role"] == "assistant":
        turn = turns[-1]
        turn["content"] += ("\n\n" if turn["content"] and text else "") + text
    else:
        turn = {"role": "assistant", "content": text}
        turns.append(turn)
    if uses:
        turn.setdefault("tool_calls", []).extend(
            {"name": b.name, "arguments": b.input} for b in uses
        )


def _user_turn(
    turns: list[dict[str, Any]], blocks: list[Any], calls: dict[str, str], i: int
) -> None:
    for j, block in enumerate(blocks):
        if isinstance(block, ToolUseBlock):
            raise ApiError(
                400, f"messages.{i}.content.{j}: tool_use blocks are for assistant turns"
            )
        if isinstance(block, ToolResultBlock):
            turns.append(_tool_turn(block, calls, f"messages.{i}.content.{j}"))
        elif turns and turns[-1]["role"] == "user":
            turns[-1]["content"] += "\n\n" + block.text
        else:
            turns.append({"role": "user", "content": block.text})


def _tool_turn(block: ToolResultBlock, calls: dict[str, str], at: str) -> dict[str, Any]:
    name = calls.get(block.tool_use_id)
    if name is None:
        raise ApiError(
            400,
            f"{at}: unexpected `tool_use_id` found in `tool_result` blocks: {block.tool_use_id}."
            " Each `tool_result` block must have a corresponding `tool_use` block before it.",
        )
    content = _join(block.content)
    if block.is_error:
        content = "Error: " + content
    return {"role": "tool", "content": content, "name": name}


def _join(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def tool_use_id() -> str:
    return "toolu_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_use_id(), "name": call.name, "input": call.arguments}


# What a piece of output adds: text, whole tool_use blocks, a streamed block begun (its
# tool_use block, input still {}) and more of the streamed block's input JSON text.
Added = tuple[str, list[dict[str, Any]], dict[str, Any] | None, str]


@dataclass(slots=True)
class ToolOutput:
    """Reads the model's output for calls, piece by piece: the text before the first call
    (blank text held back until it is decided) and the calls, a forced one as it is decoded
    (forced_stream.py), the others once whole and validated."""

    parser: ToolParser | None  # None: tool_choice none, all is text
    single: bool  # disable_parallel_tool_use: the first call only
    text: str = ""  # the text given out so far
    pending: str = ""  # blank text held back
    calls: list[dict[str, Any]] = field(default_factory=list)
    open: dict[str, Any] | None = None  # the block being streamed, until its call ends

    @classmethod
    def of(
        cls, request: MessagesRequest, tools: list[Tool], parser: ParserFactory = HermesParser
    ) -> ToolOutput:
        """Calls read in `parser`'s format; a forced call (any, tool) is always Hermes,
        streamed as it is decoded."""
        choice = request.tool_choice
        if isinstance(choice, ChoiceNone):
            return cls(None, False)
        single = bool(choice is not None and choice.disable_parallel_tool_use)
        forced = isinstance(choice, ChoiceAny | ChoiceTool)
        return cls((ForcedCallParser if forced else parser)(ToolSet(tools)), single)

    def feed(self, piece: str, final: bool = False) -> Added:
        """(new text, new whole tool_use blocks, a streamed block begun, more of its input)
        for the next piece of output."""
        if self.parser is None:
            return self._add_text(piece, final), [], None, ""
        parsed = self.parser.feed(piece)
        if final:
            rest = self.parser.finish()
            parsed.text, parsed.calls = parsed.text + rest.text, parsed.calls + rest.calls
        opened = self._open(parsed.opened)
        fragment = parsed.fragment if self.open is not None else ""
        new_text = self._add_text(parsed.text, final)
        return new_text, self._add_calls(parsed.calls), opened, fragment

    def _open(self, name: str | None) -> dict[str, Any] | None:
        if name is None or (self.single and self.calls):
            return None
        self.open = {"type": "tool_use", "id": tool_use_id(), "name": name, "input": {}}
        return self.open

    def _add_calls(self, found: list[ToolCall]) -> list[dict[str, Any]]:
        if self.open is not None and found:  # the streamed call's end: sent already
            self.open["input"] = found.pop(0).arguments
            self.calls.append(self.open)
            self.open = None
        room = 1 - len(self.calls) if self.single else len(found)
        blocks = [tool_use_block(c) for c in found[: max(room, 0)]]
        self.calls += blocks
        return blocks

    def _add_text(self, text: str, final: bool) -> str:
        if self.calls or self.open is not None:
            return ""
        self.pending += text
        if self.pending.strip() or final:
            out, self.pending = self.pending, ""
            self.text += out
            return out
        return ""

    def content(self) -> list[dict[str, Any]]:
        """The response's content blocks, once the output is all fed."""
        if not self.calls:
            return [{"type": "text", "text": self.text}]
        text = [{"type": "text", "text": self.text}] if self.text else []
        return text + self.calls


@dataclass(slots=True)
class ToolEvents:
    """The SSE events of a tool-use response's content: a text block (index 0) while there
    is text, then each call as a block of its own, indexes consecutive (from `first`: 1
    after a thinking block, whose index 0 is then `index`). A whole call is its block's
    start and one `input_json_delta`; a streamed one its start once its name is read, then an
    `input_json_delta` per piece of its input. A block stops when the next starts, or at
    `end`."""

    index: int = -1
    text_open: bool = False
    first: int = 0

    def events(
        self,
        text: str,
        blocks: list[dict[str, Any]],
        opened: dict[str, Any] | None = None,
        fragment: str = "",
    ) -> bytes:
        out = b""
        if text:
            if not self.text_open:
                out += self._start({"type": "text", "text": ""})
                self.text_open = True
            delta = {"type": "text_delta", "text": text}
            out += sse_event("content_block_delta", {"index": self.index, "delta": delta})
        if opened is not None:
            out += self._stop() + self._start({**opened, "input": {}})
        if fragment:
            out += self._input(fragment)
        for block in blocks:
            out += self._stop() + self._start({**block, "input": {}})
            out += self._input(orjson.dumps(block["input"]).decode())
        return out

    def _input(self, partial: str) -> bytes:
        delta = {"type": "input_json_delta", "partial_json": partial}
        return sse_event("content_block_delta", {"index": self.index, "delta": delta})

    def end(self) -> bytes:
        """The last block's stop (an empty text block first when there was no content)."""
        if self.index < self.first:
            return self._start({"type": "text", "text": ""}) + self._stop()
        return self._stop()

    def _start(self, block: dict[str, Any]) -> bytes:
        self.index += 1
        return sse_event("content_block_start", {"index": self.index, "content_block": block})

    def _stop(self) -> bytes:
        self.text_open = False
        if self.index < self.first:
            return b""
        return sse_event("content_block_stop", {"index": self.index})


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (name.encode(), orjson.dumps({"type": name, **data}))
