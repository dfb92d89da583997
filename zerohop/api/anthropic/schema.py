"""Anthropic Messages API request bodies as msgspec Structs, and their validation errors.

Unknown top-level fields are rejected as the API does ("<field>: Extra inputs are not
permitted"); fields the API knows but this server does not implement (mcp_servers, ...)
are rejected with a message that says so, rather than silently ignored. An explicit `null` is
the field's default, as if absent (`null_defaults`); on a required field it is refused as missing.

Every field the current API (anthropic SDK 2.16, beta included) sends is decoded. Accepted and
ignored, since they choose among a provider's fleets, bill, or configure what this server does
not run: `cache_control` (on the request, every block, system blocks and tools: prefix caching
is automatic), `metadata.user_id`, `service_tier`, `speed`, `inference_geo`, `container`,
`diagnostics`, `user_profile_id`, `workspace_id`, `billing_policy`, `fallbacks`,
`fallback_credit_token`, `output_config.effort` / `task_budget`, a text block's `citations`,
tool_use's `caller` and `toolset_name`, tool_result's `toolset_name`, and a tool's
`allowed_callers`, `defer_loading`, `input_examples` and `eager_input_streaming`. Honoured:
`context_management` (anthropic/context.py) and `role: "system"` messages (anthropic/turns.py).
`thread` (the message-threads beta: anthropic/threads.py), `compaction` and compaction blocks
(anthropic/compaction.py). Refused as not supported: `mcp_servers`. Blocks this text-only
server cannot take (image, document, search_result, ...) decode as `UnsupportedBlock`s so
that anthropic/turns.py can name them in its 400.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from zerohop.api.errors import ApiError
from zerohop.api.http.null_defaults import NullMeansDefault

# Fields of the real API this server does not implement: a request using them is refused.
UNSUPPORTED_FIELDS = frozenset({"mcp_servers"})


class TextBlock(NullMeansDefault, tag="text", tag_field="type", forbid_unknown_fields=True):
    text: str
    cache_control: Any = None  # accepted and ignored: prefix caching is automatic
    citations: Any = None


class ToolUseBlock(NullMeansDefault, tag="tool_use", tag_field="type", forbid_unknown_fields=True):
    """A call the assistant made, in an earlier assistant turn."""

    id: str
    name: str
    input: dict[str, Any]
    cache_control: Any = None
    caller: Any = None  # accepted and ignored: every call here is the model's own ("direct")
    toolset_name: str | None = None  # accepted and ignored


class ServerToolUseBlock(
    NullMeansDefault, tag="server_tool_use", tag_field="type", forbid_unknown_fields=True
):
    """A server tool's call (web search, code execution, ...) that Anthropic's API ran, in a
    conversation begun there: accepted, and left out of the prompt with its result."""

    id: str
    name: str
    input: dict[str, Any]
    cache_control: Any = None
    caller: Any = None


class UnsupportedBlock(msgspec.Struct, tag_field="type"):
    """A block this server does not render, decoded whatever its fields so that
    anthropic/turns.py can name it in a 400 (media) or leave it out (a server tool's result)."""

    @property
    def kind(self) -> str:
        return type(self).__struct_config__.tag  # type: ignore[return-value]


# Content a text-only model cannot take: a 400 naming the block.
class ImageBlock(UnsupportedBlock, tag="image"):
    pass


class DocumentBlock(UnsupportedBlock, tag="document"):
    pass


class SearchResultBlock(UnsupportedBlock, tag="search_result"):
    pass


class ToolReferenceBlock(UnsupportedBlock, tag="tool_reference"):
    pass


class BrowserStateBlock(UnsupportedBlock, tag="browser_state"):
    pass


MediaBlock = ImageBlock | DocumentBlock | SearchResultBlock | ToolReferenceBlock | BrowserStateBlock


# A server tool's results (after its server_tool_use): accepted and left out of the prompt.
class ServerToolResultBlock(UnsupportedBlock):
    pass


class WebSearchResultBlock(ServerToolResultBlock, tag="web_search_tool_result"):
    pass


class WebFetchResultBlock(ServerToolResultBlock, tag="web_fetch_tool_result"):
    pass


class CodeExecutionResultBlock(ServerToolResultBlock, tag="code_execution_tool_result"):
    pass


class BashCodeExecutionResultBlock(ServerToolResultBlock, tag="bash_code_execution_tool_result"):
    pass


class TextEditorResultBlock(ServerToolResultBlock, tag="text_editor_code_execution_tool_result"):
    pass


class ToolSearchResultBlock(ServerToolResultBlock, tag="tool_search_tool_result"):
    pass


class ContainerUploadBlock(ServerToolResultBlock, tag="container_upload"):
    pass


ServerResultBlock = (
    WebSearchResultBlock
    | WebFetchResultBlock
    | CodeExecutionResultBlock
    | BashCodeExecutionResultBlock
    | TextEditorResultBlock
    | ToolSearchResultBlock
    | ContainerUploadBlock
)


class ToolResultBlock(
    NullMeansDefault, tag="tool_result", tag_field="type", forbid_unknown_fields=True
):
    """The result of a call, in the user turn after it."""

    tool_use_id: str
    content: str | list[TextBlock | MediaBlock] | None = ""
    is_error: bool | None = False
    cache_control: Any = None
    toolset_name: str | None = None  # accepted and ignored


class ThinkingBlock(NullMeansDefault, tag="thinking", tag_field="type", forbid_unknown_fields=True):
    """A thought of an earlier assistant turn, with the signature this server gave it."""

    thinking: str
    signature: str
    cache_control: Any = None


class RedactedThinkingBlock(
    NullMeansDefault, tag="redacted_thinking", tag_field="type", forbid_unknown_fields=True
):
    """An encrypted thought (Anthropic's API writes them; this server never does): accepted
    and left out of the prompt, as past thoughts are."""

    data: str
    cache_control: Any = None


class CompactionBlock(
    NullMeansDefault, tag="compaction", tag_field="type", forbid_unknown_fields=True
):
    """A summary of the turns before it, as this server wrote and signed it
    (anthropic/compaction.py); `content` null: a failed compaction, a no-op."""

    content: str | None = None
    signature: str | None = None
    encrypted_content: str | None = None  # accepted, unread: this server's is `signature`
    tool_changes: list[Any] | None = None  # accepted, unread
    cache_control: Any = None


Block = (
    TextBlock
    | CompactionBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
    | ServerToolUseBlock
    | MediaBlock
    | ServerResultBlock
)


class ThinkingEnabled(
    NullMeansDefault, tag="enabled", tag_field="type", forbid_unknown_fields=True
):
    budget_tokens: int
    display: str | None = None  # how a thought is shown ("summarized", "omitted", "updates")


class ThinkingAdaptive(
    NullMeansDefault, tag="adaptive", tag_field="type", forbid_unknown_fields=True
):
    display: str | None = None  # any value: it shapes what is shown of a thought, not it


class ThinkingDisabled(
    NullMeansDefault, tag="disabled", tag_field="type", forbid_unknown_fields=True
):
    pass


class ThinkingBetweenTools(
    NullMeansDefault, tag="between_tools", tag_field="type", forbid_unknown_fields=True
):
    """Think between tool calls: here, as `adaptive` (the model decides)."""

    display: str | None = None


Thinking = ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled | ThinkingBetweenTools


class Message(msgspec.Struct, forbid_unknown_fields=True):
    """A turn; `system` (the mid-conversation-system beta) takes text blocks only."""

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]
    # The per-turn-control beta's settings for the turn (effort, ...): accepted, ignored.
    output_config: Any = None


class ToolDef(NullMeansDefault, forbid_unknown_fields=True):
    """A client tool. `input_schema` is checked where it is used (a server tool has none)."""

    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = ""
    strict: bool | None = False
    type: str | None = "custom"
    cache_control: Any = None  # accepted and ignored, as in TextBlock
    eager_input_streaming: bool | None = None  # accepted: calls stream whole anyway
    # Accepted and ignored: callers are the model's own, every tool is loaded, and the
    # examples are not shown to the model.
    allowed_callers: list[str] | None = None
    defer_loading: bool | None = None
    input_examples: list[dict[str, Any]] | None = None


class ChoiceAuto(NullMeansDefault, tag="auto", tag_field="type", forbid_unknown_fields=True):
    disable_parallel_tool_use: bool | None = False


class ChoiceAny(NullMeansDefault, tag="any", tag_field="type", forbid_unknown_fields=True):
    disable_parallel_tool_use: bool | None = False


class ChoiceTool(NullMeansDefault, tag="tool", tag_field="type", forbid_unknown_fields=True):
    name: str
    disable_parallel_tool_use: bool | None = False


class ChoiceNone(NullMeansDefault, tag="none", tag_field="type", forbid_unknown_fields=True):
    pass


ToolChoice = ChoiceAuto | ChoiceAny | ChoiceTool | ChoiceNone


class Metadata(NullMeansDefault, forbid_unknown_fields=True):
    user_id: str | None = None


class OutputFormat(NullMeansDefault, forbid_unknown_fields=True):
    """The output's JSON schema (`output_config.format`, or the beta's `output_format`)."""

    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(NullMeansDefault, forbid_unknown_fields=True):
    format: OutputFormat | None = None
    # Accepted and ignored: effort levels and task budgets are not mapped to the thought
    # (thinking.budget_tokens is the budget zerohop enforces).
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    task_budget: Any = None


# -- context management (anthropic/context.py) ---------------------------------------------

Count = Annotated[int, msgspec.Meta(ge=0)]


class InputTokens(
    NullMeansDefault, tag="input_tokens", tag_field="type", forbid_unknown_fields=True
):
    value: Count


class ToolUses(NullMeansDefault, tag="tool_uses", tag_field="type", forbid_unknown_fields=True):
    value: Count


class ThinkingTurns(
    NullMeansDefault, tag="thinking_turns", tag_field="type", forbid_unknown_fields=True
):
    value: Count


class AllThinkingTurns(NullMeansDefault, tag="all", tag_field="type", forbid_unknown_fields=True):
    pass


class ClearToolUses(
    NullMeansDefault, tag="clear_tool_uses_20250919", tag_field="type", forbid_unknown_fields=True
):
    trigger: InputTokens | ToolUses | None = None
    keep: ToolUses | None = None
    clear_at_least: InputTokens | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] | None = None


class ClearThinking(
    NullMeansDefault, tag="clear_thinking_20251015", tag_field="type", forbid_unknown_fields=True
):
    keep: ThinkingTurns | AllThinkingTurns | Literal["all"] | None = None


class Compact(
    NullMeansDefault, tag="compact_20260112", tag_field="type", forbid_unknown_fields=True
):
    """Server-side compaction, a summary written by the model (anthropic/compaction.py)."""

    trigger: InputTokens | None = None
    instructions: str | None = None
    pause_after_compaction: bool | None = False


class CompactionRequest(NullMeansDefault, forbid_unknown_fields=True):
    """The explicit compaction request (`compaction`, beta compact-2026-09-04)."""

    type: Literal["summarize"]
    instructions: str | None = None


class ContextManagement(NullMeansDefault, forbid_unknown_fields=True):
    edits: list[ClearToolUses | ClearThinking | Compact] | None = None


# -- message threads (anthropic/threads.py) -------------------------------------------------


class ThreadCreate(NullMeansDefault, tag="create", tag_field="type", forbid_unknown_fields=True):
    """Keep this conversation, with its answer, under the response's `id`."""


class ThreadContinue(
    NullMeansDefault, tag="continue", tag_field="type", forbid_unknown_fields=True
):
    """Put the thread that ends at `previous_message_id` before this request's messages."""

    previous_message_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class CountTokensRequest(NullMeansDefault, kw_only=True, forbid_unknown_fields=True):
    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    cache_control: Any = None  # accepted and ignored, as in TextBlock
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None  # anthropic/turns.py
    context_management: ContextManagement | None = None  # anthropic/context.py
    compaction: CompactionRequest | None = None  # anthropic/compaction.py; count_tokens: ignored
    output_config: OutputConfig | None = None  # its format is not part of the prompt
    # Accepted and ignored (see the module docstring).
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class MessagesRequest(CountTokensRequest, kw_only=True, forbid_unknown_fields=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    metadata: Metadata | None = None
    stream: bool | None = False
    # Accepted and ignored: they choose among a provider's fleets, bill, or configure server
    # tools and diagnostics this server does not have.
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    container: str | dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    billing_policy: dict[str, Any] | None = None
    fallbacks: str | list[Any] | None = None
    fallback_credit_token: str | dict[str, Any] | None = None
    # Structured outputs (`output_config.format`): the text is JSON matching the schema.
    # `output_format` is the structured-outputs beta's spelling (older SDKs'
    # `beta.messages.parse`).
    output_format: OutputFormat | None = None
    # zerohop's failover extensions (zerohop.client sends them): each text event carries the
    # ids of its tokens, and a request can continue another replica's partial answer.
    return_token_ids: bool | None = False
    continue_token_ids: list[int] | None = None
    thread: ThreadCreate | ThreadContinue | None = None  # anthropic/threads.py


_MESSAGES = msgspec.json.Decoder(MessagesRequest)
_COUNT_TOKENS = msgspec.json.Decoder(CountTokensRequest)

_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_FIELD = re.compile(r"`(?P<name>[^`]+)`")
_NULL = re.compile(r"^Expected `[^`]*`, got `null`$")  # a required field sent as null
T = TypeVar("T")
_INVALID_TAG = re.compile(r"^Invalid value '(?P<value>[^']*)'$")


def decode_messages(body: bytes) -> MessagesRequest:
    return _decode(_MESSAGES, body)


def decode_count_tokens(body: bytes) -> CountTokensRequest:
    return _decode(_COUNT_TOKENS, body)


def _decode(decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise ApiError(400, validation_message(str(exc))) from None
    except msgspec.DecodeError as exc:
        if "UTF-8" in str(exc):
            raise ApiError(400, f"the request body is not valid UTF-8: {exc}") from None
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


def validation_message(raw: str) -> str:
    """msgspec's message, rewritten in the API's '<dotted.path>: <problem>' form."""
    match = _AT.search(raw)
    path = _dotted(match["path"]) if match else ""
    problem = raw[: match.start()] if match else raw
    if problem.startswith(("Object missing required field", "Object contains unknown field")):
        field = _FIELD.search(problem)
        name = field["name"] if field else problem
        full = f"{path}.{name}" if path else name
        if problem.startswith("Object missing"):
            return f"{full}: Field required"
        if not path and name in UNSUPPORTED_FIELDS:
            return f"{name}: not supported by this server"
        return f"{full}: Extra inputs are not permitted"
    if _NULL.match(problem) and match and not match["path"].endswith("]"):
        return f"{path}: Field required"
    if (tag := _INVALID_TAG.match(problem)) and path.endswith(".type") and ".content." in path:
        return (
            f"{path}: '{tag['value']}' content blocks are not supported by this server"
            " (only 'text', 'thinking', 'redacted_thinking', 'tool_use', 'tool_result' and"
            " the server tools' blocks)"
        )
    if not path:
        return f"the request body is invalid: {problem}"
    return f"{path}: {problem}"


def _dotted(path: str) -> str:
    """`.messages[0].content` -> `messages.0.content`."""
    return path.replace("[", ".").replace("]", "").lstrip(".")
