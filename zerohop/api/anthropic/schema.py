"""Anthropic Messages API request bodies as msgspec Structs, and their validation errors.

Unknown top-level fields are rejected as the API does ("<field>: Extra inputs are not
permitted"); fields the API knows but this server does not implement (mcp_servers, ...)
are rejected with a message that says so, rather than silently ignored. An explicit `null` is
the field's default, as if absent (`null_defaults`); on a required field it is refused as missing.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from zerohop.api.errors import ApiError
from zerohop.api.http.null_defaults import NullMeansDefault

# Fields of the real API this server does not implement: a request using them is refused.
UNSUPPORTED_FIELDS = frozenset(
    {
        "mcp_servers",
        "container",
        "context_management",
        "diagnostics",
        "user_profile_id",
        "workspace_id",
    }
)


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


class ToolResultBlock(
    NullMeansDefault, tag="tool_result", tag_field="type", forbid_unknown_fields=True
):
    """The result of a call, in the user turn after it."""

    tool_use_id: str
    content: str | list[TextBlock] | None = ""
    is_error: bool | None = False
    cache_control: Any = None


class ThinkingBlock(NullMeansDefault, tag="thinking", tag_field="type", forbid_unknown_fields=True):
    """A thought of an earlier assistant turn, with the signature this server gave it."""

    thinking: str
    signature: str


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class ThinkingEnabled(
    NullMeansDefault, tag="enabled", tag_field="type", forbid_unknown_fields=True
):
    budget_tokens: int
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(
    NullMeansDefault, tag="adaptive", tag_field="type", forbid_unknown_fields=True
):
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(
    NullMeansDefault, tag="disabled", tag_field="type", forbid_unknown_fields=True
):
    pass


Thinking = ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(NullMeansDefault, forbid_unknown_fields=True):
    """A client tool. `input_schema` is checked where it is used (a server tool has none)."""

    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = ""
    strict: bool | None = False
    type: str | None = "custom"
    cache_control: Any = None  # accepted and ignored, as in TextBlock
    eager_input_streaming: bool | None = None  # accepted: calls stream whole anyway


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


class CountTokensRequest(NullMeansDefault, kw_only=True, forbid_unknown_fields=True):
    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    cache_control: Any = None  # accepted and ignored, as in TextBlock
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None  # anthropic/turns.py


class MessagesRequest(CountTokensRequest, kw_only=True, forbid_unknown_fields=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    metadata: Metadata | None = None
    stream: bool | None = False
    # Accepted and ignored: they choose among a provider's fleets, and this is one server.
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    # Structured outputs: the text is JSON matching the schema. `output_format` is the
    # structured-outputs beta's spelling (older SDKs' `beta.messages.parse`).
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None
    # zerohop's failover extensions (zerohop.client sends them): each text event carries the
    # ids of its tokens, and a request can continue another replica's partial answer.
    return_token_ids: bool | None = False
    continue_token_ids: list[int] | None = None


_MESSAGES = msgspec.json.Decoder(MessagesRequest)
_COUNT_TOKENS = msgspec.json.Decoder(CountTokensRequest)

_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_FIELD = re.compile(r"`(?P<name>[^`]+)`")
_NULL = re.compile(r"^Expected `[^`]*`, got `null`$")  # a required field sent as null
_INVALID_TAG = re.compile(r"^Invalid value '(?P<value>[^']*)'$")


def decode_messages(body: bytes) -> MessagesRequest:
    return _decode(_MESSAGES, body)


def decode_count_tokens(body: bytes) -> CountTokensRequest:
    return _decode(_COUNT_TOKENS, body)


def _decode(decoder: msgspec.json.Decoder, body: bytes) -> Any:
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
            " (only 'text', 'thinking', 'tool_use' and 'tool_result')"
        )
    if not path:
        return f"the request body is invalid: {problem}"
    return f"{path}: {problem}"


def _dotted(path: str) -> str:
    """`.messages[0].content` -> `messages.0.content`."""
    return path.replace("[", ".").replace("]", "").lstrip(".")
