"""Context editing (`context_management.edits`): applied to the request's messages before they
become turns (anthropic/turns.py), as the API applies them before the prompt reaches the model.

Decisions where the API leaves room:
- `clear_tool_uses_20250919`: once the trigger is passed (more input tokens than its value,
  by default 100,000, or more tool uses than its value), the results of the oldest tool uses
  are replaced by `PLACEHOLDER`, all but the most recent `keep` (default 3; they stay whatever
  their tool) and those of `exclude_tools`. A tool use is a tool_use block with the
  tool_result answering it (one without a result has nothing to clear). `clear_tool_inputs`
  (true, or the names of the tools concerned) empties the cleared uses' inputs too. With
  `clear_at_least`, the edit applies only when it clears at least that many input tokens.
  `cleared_input_tokens` is the prompt's token count before the edit less after it.
- `clear_thinking_20251015`: thinking (and redacted_thinking) blocks are dropped from all but
  the last `keep` (default 1 thinking turn) assistant messages that hold one; "all" keeps
  every one. A dropped thought's signature is not checked. Its `cleared_input_tokens` counts
  the thoughts of the current tool loop (after the last user message with text), the only
  ones rendered into the prompt (anthropic/turns.py); dropping earlier ones frees nothing.
- Edits apply in their order, each to the result of those before it; an edit that clears
  nothing is left out of `applied_edits`. `compact_20260112` (a summary the model writes)
  is decided here, on the prompt as the edits before it left it (its trigger: more input
  tokens than its value, by default 150,000) and done by anthropic/compaction.py. Its
  trigger must be at least 50,000 input tokens, as documented (a 400 otherwise, on
  count_tokens too); an operator may lower that floor with the environment variable
  `ZEROHOP_COMPACT_MIN_TRIGGER` (small models, tests).
- A compaction block a request carries (`expand_compactions`, before any edit) is verified
  (api/compaction/seal.py; one that does not verify is a 400) and the messages before the
  last one are replaced by its summary, a user-side note opening the conversation, as the
  API drops what the block summarizes. A block with null `content` (a failed compaction)
  is a no-op.
- The input-token counts are the prompt as count_tokens counts it; a request with no edit
  whose trigger counts tokens is not counted an extra time.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from zerohop.api.anthropic.schema import (
    AllThinkingTurns,
    ClearThinking,
    ClearToolUses,
    Compact,
    CompactionBlock,
    CountTokensRequest,
    InputTokens,
    Message,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    ToolUses,
)
from zerohop.api.compaction.seal import Sealer
from zerohop.api.compaction.summarize import framed
from zerohop.api.errors import ApiError

PLACEHOLDER = "[this tool result was cleared to save context]"
DEFAULT_TRIGGER = 100_000  # input tokens
DEFAULT_KEEP_TOOL_USES = 3
DEFAULT_KEEP_THINKING_TURNS = 1
DEFAULT_COMPACT_TRIGGER = 150_000  # input tokens
MIN_COMPACT_TRIGGER = 50_000  # input tokens, the API's documented floor
MIN_COMPACT_TRIGGER_ENV = "ZEROHOP_COMPACT_MIN_TRIGGER"  # the operator's override

Counter = Callable[[CountTokensRequest], int]


@dataclass(slots=True)
class Edited:
    """The request once edited (`request`) and the edits applied (`applied_edits`)."""

    source: CountTokensRequest
    request: CountTokensRequest
    applied: list[dict[str, Any]] = field(default_factory=list)
    source_tokens: int | None = None  # the unedited prompt's tokens, when they were counted
    compact: Compact | None = None  # a compaction edit whose trigger is exceeded

    def response(self) -> dict[str, Any]:
        """The response's `context_management`."""
        return {"applied_edits": self.applied}

    def original_tokens(self, final: int, count: Counter) -> int:
        """The unedited prompt's token count (count_tokens' `original_input_tokens`), given
        the edited one's (`final`)."""
        if self.source_tokens is not None:
            return self.source_tokens
        return final if self.request is self.source else count(self.source)


@dataclass(slots=True)
class _State:
    source: CountTokensRequest
    count: Counter
    request: CountTokensRequest = field(init=False)
    tokens: int | None = None  # of `request`, once counted
    source_tokens: int | None = None

    def __post_init__(self) -> None:
        self.request = self.source

    def counted(self) -> int:
        if self.tokens is None:
            self.tokens = self.count(self.request)
            if self.request is self.source:
                self.source_tokens = self.tokens
        return self.tokens


@dataclass(slots=True)
class _Use:
    """A tool use: where its tool_use and tool_result blocks are (message, block)."""

    name: str
    call: tuple[int, int]
    result: tuple[int, int]


def edit_context(request: CountTokensRequest, count: Counter) -> Edited | None:
    """The request with its context edits applied; None when it has no context_management."""
    config = request.context_management
    if config is None:
        return None
    state = _State(request, count)
    applied = []
    compact = None
    for i, edit in enumerate(config.edits or []):
        if isinstance(edit, Compact):
            trigger = edit.trigger or InputTokens(DEFAULT_COMPACT_TRIGGER)
            _check_compact_trigger(trigger, f"context_management.edits.{i}.trigger.value")
            compact = edit if state.counted() > trigger.value else compact
            continue
        done = _clear_tool_uses(edit, state) if isinstance(edit, ClearToolUses) else None
        if isinstance(edit, ClearThinking):
            done = _clear_thinking(edit, state)
        if done is not None:
            applied.append(done)
    return Edited(request, state.request, applied, state.source_tokens, compact)


def min_compact_trigger() -> int:
    """The least compaction trigger a request may set (module docstring)."""
    value = os.environ.get(MIN_COMPACT_TRIGGER_ENV, "").strip()
    return int(value) if value.isdigit() else MIN_COMPACT_TRIGGER


def _check_compact_trigger(trigger: InputTokens, at: str) -> None:
    least = min_compact_trigger()
    if trigger.value < least:
        message = f"{at}: the compaction trigger must be at least {least} input tokens"
        raise ApiError(400, message, param=at)


# -- compaction blocks ----------------------------------------------------------------------


def compacts(request: CountTokensRequest) -> bool:
    """Whether the request may compact (and so sign a compaction block)."""
    edits = request.context_management.edits if request.context_management else None
    compact = any(isinstance(e, Compact) for e in edits or ())
    return compact or getattr(request, "compaction", None) is not None


def compaction_signatures(request: CountTokensRequest) -> list[str]:
    """The signatures of the request's compaction blocks (their keys are read first)."""
    return [
        block.signature
        for message in request.messages
        for block in _content(message)
        if isinstance(block, CompactionBlock) and block.signature
    ]


def expand_compactions(request: CountTokensRequest, sealer: Sealer) -> CountTokensRequest:
    """The request with its last compaction block's summary in place of the messages before
    it (module docstring); the request itself when it carries none."""
    messages = request.messages
    where = [
        (i, j)
        for i, m in enumerate(messages)
        for j, b in enumerate(_content(m))
        if isinstance(b, CompactionBlock)
    ]
    if not where:
        return request
    full = [(i, j) for i, j in where if _content(messages[i])[j].content is not None]
    start, summary = 0, None
    if full:
        i, j = full[-1]
        block = _content(messages[i])[j]
        sealer.verify(block.content, block.signature or "", f"messages.{i}.content.{j}")
        summary, start = Message("user", [TextBlock(text=framed(block.content))]), i
    kept = [
        Message(m.role, [b for b in _content(m) if not isinstance(b, CompactionBlock)])
        if any(isinstance(b, CompactionBlock) for b in _content(m))
        else m
        for m in messages[start:]
    ]
    kept = [m for m in kept if m.content]
    return msgspec.structs.replace(request, messages=[summary, *kept] if summary else kept)


# -- clear_tool_uses ------------------------------------------------------------------------


def _clear_tool_uses(edit: ClearToolUses, state: _State) -> dict[str, Any] | None:
    messages = state.request.messages
    uses = _tool_uses(messages)
    trigger = edit.trigger or InputTokens(DEFAULT_TRIGGER)
    size = len(uses) if isinstance(trigger, ToolUses) else state.counted()
    if size <= trigger.value:
        return None
    keep = (edit.keep or ToolUses(DEFAULT_KEEP_TOOL_USES)).value
    excluded = set(edit.exclude_tools or ())
    cleared = [u for u in uses[: max(0, len(uses) - keep)] if u.name not in excluded]
    if not cleared:
        return None
    before = state.counted()
    request = msgspec.structs.replace(
        state.request, messages=_cleared(messages, cleared, edit.clear_tool_inputs)
    )
    after = state.count(request)
    if edit.clear_at_least is not None and before - after < edit.clear_at_least.value:
        return None
    state.request, state.tokens = request, after
    return {
        "type": "clear_tool_uses_20250919",
        "cleared_tool_uses": len(cleared),
        "cleared_input_tokens": max(0, before - after),
    }


def _tool_uses(messages: list[Message]) -> list[_Use]:
    """The tool uses that have a result, oldest call first."""
    calls: dict[str, tuple[str, tuple[int, int]]] = {}  # tool_use id -> (name, where)
    uses = []
    for i, message in enumerate(messages):
        for j, block in enumerate(_content(message)):
            if isinstance(block, ToolUseBlock) and message.role == "assistant":
                calls[block.id] = (block.name, (i, j))
            elif isinstance(block, ToolResultBlock) and block.tool_use_id in calls:
                name, call = calls.pop(block.tool_use_id)
                uses.append(_Use(name, call, (i, j)))
    return sorted(uses, key=lambda use: use.call)


def _cleared(
    messages: list[Message], uses: list[_Use], inputs: bool | list[str] | None
) -> list[Message]:
    """The messages with the uses' results (and, per `inputs`, their inputs) cleared."""
    blocks = {i: list(_content(m)) for i, m in enumerate(messages)}
    touched = set()
    for use in uses:
        i, j = use.result
        blocks[i][j] = msgspec.structs.replace(blocks[i][j], content=PLACEHOLDER)
        touched.add(i)
        if inputs is True or (isinstance(inputs, list) and use.name in inputs):
            i, j = use.call
            blocks[i][j] = msgspec.structs.replace(blocks[i][j], input={})
            touched.add(i)
    return [Message(m.role, blocks[i]) if i in touched else m for i, m in enumerate(messages)]


# -- clear_thinking -------------------------------------------------------------------------

_THOUGHTS = (ThinkingBlock, RedactedThinkingBlock)


def _clear_thinking(edit: ClearThinking, state: _State) -> dict[str, Any] | None:
    keep = edit.keep
    if keep == "all" or isinstance(keep, AllThinkingTurns):
        return None
    kept = DEFAULT_KEEP_THINKING_TURNS if keep is None else keep.value
    messages = state.request.messages
    thinking = [
        i
        for i, m in enumerate(messages)
        if m.role == "assistant" and any(isinstance(b, _THOUGHTS) for b in _content(m))
    ]
    dropped = set(thinking[: max(0, len(thinking) - kept)])
    if not dropped:
        return None
    edited = [
        Message(m.role, [b for b in _content(m) if not isinstance(b, _THOUGHTS)])
        if i in dropped
        else m
        for i, m in enumerate(messages)
    ]
    request = msgspec.structs.replace(state.request, messages=edited)
    cleared = 0
    if max(dropped) > _last_query(messages):  # a rendered thought (module docstring)
        before = state.counted()
        state.tokens = state.count(request)
        cleared = max(0, before - state.tokens)
    state.request = request  # else the prompt is the same, and so is its count
    return {
        "type": "clear_thinking_20251015",
        "cleared_thinking_turns": len(dropped),
        "cleared_input_tokens": cleared,
    }


def _last_query(messages: list[Message]) -> int:
    """The index of the last user message with text (-1: none): the current tool loop's
    assistant turns come after it."""
    for i in range(len(messages) - 1, -1, -1):
        content = messages[i].content
        texts = (
            [content]
            if isinstance(content, str)
            else [b.text for b in content if isinstance(b, TextBlock)]
        )
        if messages[i].role == "user" and any(texts):
            return i
    return -1


def _content(message: Message) -> list[Any]:
    return [] if isinstance(message.content, str) else message.content
