"""Tools on the Responses surface: `tools`, `tool_choice` and `parallel_tool_calls` as the
neutral conversation's (api/conversation/request.py).

What the surface decides:
- `function` tools are the model's functions (flat: `name`, `description`, `parameters`,
  `strict`). `strict` absent is true (the API's default for this surface): the call's
  arguments are decoded in the tool's schema. The response echoes each function tool
  normalized, as the API does: `description` and `parameters` null when absent, `strict`
  set. A `namespace` groups functions and custom tools: each is offered under its own
  name, and under `namespace__name` when two namespaces (or a namespace and the top level)
  use the same name; a call of it comes back with its `namespace`.
- `custom` tools take raw text (tools/raw_input.py): a `grammar` format (`lark` or `regex`)
  is compiled where it enters (a grammar the backend cannot compile is a 400 naming the
  tool) and enforced: decoded when the call is forced, checked before a call is given out
  otherwise. A `text` format (or none) is free text.
- Hosted tools (`web_search`, `file_search`, `tool_search`, `code_interpreter`, `mcp`,
  `image_generation`, `computer_use_preview`, `local_shell`, `shell`, `apply_patch`, ...)
  are accepted and not offered to the model: this server runs none of them. A `tool_choice`
  that forces one is a 400.
- `tool_choice`: "none" (no tool is offered), "auto", "required", `{"type": "function",
  "name"}`, `{"type": "custom", "name"}`, and `{"type": "allowed_tools", "mode", "tools"}`
  (the tools listed are the ones offered, in that mode). `parallel_tool_calls: false` keeps
  the first call only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from zerohop.api.conversation.request import ChoiceMode, RawCall, ToolChoice
from zerohop.api.errors import ApiError
from zerohop.api.tools.raw_input import input_parameters
from zerohop.api.tools.spec import Tool, checked_tools
from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.structured import grammar as g

_OFFERED = ("function", "custom", "namespace")
_CHOICE_MODES = ("none", "auto", "required")


@dataclass(slots=True, frozen=True)
class Offered:
    """A tool as the request declared it: its kind, its own name and its namespace."""

    kind: str  # "function" or "custom"
    name: str
    namespace: str | None = None


@dataclass(slots=True)
class RequestTools:
    """The tools offered to the model and, by the name it calls them with, what each was."""

    tools: list[Tool] = field(default_factory=list)
    offered: dict[str, Offered] = field(default_factory=dict)

    def model_name(self, name: str, namespace: str | None = None) -> str:
        """The name the model knows a declared tool by (an earlier call's item names it as
        declared); the name itself when no tool matches."""
        for known, tool in self.offered.items():
            if tool.name == name and tool.namespace == namespace:
                return known
        return name

    def is_custom(self, name: str) -> bool:
        tool = self.offered.get(name)
        return tool is not None and tool.kind == "custom"


def request_tools(given: list[Any] | None) -> RequestTools:
    """The request's tools (hosted ones left out), checked."""
    declared: list[tuple[str, Any, str | None]] = []  # (where, tool, namespace)
    for i, spec in enumerate(given or []):
        where = f"tools[{i}]"
        kind = _kind(spec, where)
        if kind == "namespace":
            declared += _namespace(spec, where)
        elif kind in _OFFERED:
            declared.append((where, spec, None))
    counts = Counter(spec.get("name") for _, spec, _ in declared)
    result = RequestTools()
    for where, spec, namespace in declared:
        name = spec.get("name")
        shown = f"{namespace}__{name}" if namespace and counts[name] > 1 else name
        tool = _tool(spec, where, shown)
        result.tools.append(tool)
        result.offered[tool.name] = Offered(spec["type"], name, namespace)
    try:
        checked_tools(result.tools)
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param="tools") from exc
    return result


def _kind(spec: Any, where: str) -> str:
    kind = spec.get("type") if isinstance(spec, dict) else None
    if not isinstance(kind, str):
        raise ApiError(400, f"Missing required parameter: '{where}.type'.", param="tools")
    return kind


def _namespace(spec: dict[str, Any], where: str) -> list[tuple[str, Any, str | None]]:
    name, tools = spec.get("name"), spec.get("tools")
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"Missing required parameter: '{where}.name'.", param="tools")
    if not isinstance(tools, list):
        raise ApiError(400, f"Missing required parameter: '{where}.tools'.", param="tools")
    inner: list[tuple[str, Any, str | None]] = []
    for j, tool in enumerate(tools):
        at = f"{where}.tools[{j}]"
        if _kind(tool, at) not in ("function", "custom"):
            raise ApiError(
                400, f"{at}.type: a namespace holds function and custom tools", param="tools"
            )
        inner.append((at, tool, name))
    return inner


def _tool(spec: dict[str, Any], where: str, name: Any) -> Tool:
    if not isinstance(name, str):
        raise ApiError(400, f"Missing required parameter: '{where}.name'.", param="tools")
    description = spec.get("description") or ""
    if not isinstance(description, str):
        raise ApiError(400, f"{where}.description must be a string", param="tools")
    if spec["type"] == "custom":
        return _custom(spec, where, name, description)
    parameters = spec.get("parameters")
    return Tool(
        name=name,
        description=description,
        parameters={"type": "object"} if parameters is None else parameters,
        strict=_strict(spec),
    )


def _strict(spec: dict[str, Any]) -> bool:
    return spec.get("strict") is not False  # absent or null: the API's default, true


def echoed_tools(given: list[Any] | None) -> list[Any]:
    """The request's tools as the response object lists them: function tools (also inside
    a namespace) normalized, every other tool as it was sent."""
    return [_echoed(spec) for spec in given or []]


def _echoed(spec: Any) -> Any:
    if not isinstance(spec, dict):
        return spec
    if spec.get("type") == "namespace" and isinstance(spec.get("tools"), list):
        return {**spec, "tools": [_echoed(tool) for tool in spec["tools"]]}
    if spec.get("type") != "function":
        return spec
    return {
        "type": "function",
        "name": spec.get("name"),
        "description": spec.get("description"),
        "parameters": spec.get("parameters"),
        "strict": _strict(spec),
        **{k: v for k, v in spec.items() if k not in _FUNCTION_FIELDS},
    }


_FUNCTION_FIELDS = ("type", "name", "description", "parameters", "strict")


def _custom(spec: dict[str, Any], where: str, name: str, description: str) -> Tool:
    fmt = spec.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return Tool(name, description, input_parameters("free text"))
    if kind != "grammar":
        raise ApiError(400, f"{where}.format.type: must be 'text' or 'grammar'", param="tools")
    syntax, definition = fmt.get("syntax"), fmt.get("definition")
    if not isinstance(definition, str) or not definition.strip():
        raise ApiError(400, f"Missing required parameter: '{where}.format.definition'.")
    try:
        if syntax == "lark":
            compiled = g.lark_grammar(definition)
        elif syntax == "regex":
            compiled = g.regex_grammar(definition)
        else:
            raise ApiError(400, f"{where}.format.syntax: must be 'lark' or 'regex'", param="tools")
    except InvalidRequestError as exc:
        raise ApiError(400, f"{where}.format.definition: {exc}", param="tools") from None
    note = f"text in this {syntax} grammar:\n{definition}"
    return Tool(name, description, input_parameters(note), input_grammar=compiled)


@dataclass(slots=True)
class Choice:
    """The neutral tool choice, the tools it offers, and a forced raw-input call."""

    choice: ToolChoice
    tools: list[Tool]
    raw_call: RawCall | None = None


def tool_choice(given: Any, parallel: bool | None, tools: RequestTools) -> Choice:
    """`tool_choice` over the request's tools (see the module docstring)."""
    parallel_calls = parallel is not False
    offered = tools.tools
    if given is None or given in _CHOICE_MODES:
        mode: ChoiceMode = given or "auto"
        return Choice(ToolChoice(mode, None, parallel_calls), [] if mode == "none" else offered)
    if not isinstance(given, dict) or not isinstance(given.get("type"), str):
        raise _choice_error()
    kind = given["type"]
    if kind == "allowed_tools":
        return _allowed(given, parallel_calls, tools)
    if kind not in ("function", "custom"):
        raise ApiError(
            400,
            f"tool_choice: {kind!r} tools are not run by this server (only function and"
            " custom tools are)",
            param="tool_choice",
        )
    name = given.get("name")
    if not isinstance(name, str):
        raise _choice_error()
    known = tools.model_name(name, given.get("namespace"))
    if known not in tools.offered or tools.offered[known].kind != kind:
        raise ApiError(
            400, f"tool_choice: no {kind} tool named {name!r} in tools", param="tool_choice"
        )
    choice = ToolChoice("named", known, parallel_calls)
    if kind == "custom":
        tool = next(t for t in offered if t.name == known)
        return Choice(choice, offered, RawCall(known, tool.input_grammar))
    return Choice(choice, offered)


def _allowed(given: dict[str, Any], parallel: bool, tools: RequestTools) -> Choice:
    mode, listed = given.get("mode"), given.get("tools")
    if mode not in ("auto", "required") or not isinstance(listed, list):
        raise _choice_error()
    names = set()
    for entry in listed:
        name = entry.get("name") if isinstance(entry, dict) else None
        if isinstance(name, str):
            names.add(tools.model_name(name, entry.get("namespace")))
    allowed = [t for t in tools.tools if t.name in names]
    if mode == "required" and not allowed:
        raise ApiError(400, "tool_choice.tools: none of them is a function or custom tool in tools")
    return Choice(ToolChoice(mode, None, parallel), allowed)


def _choice_error() -> ApiError:
    return ApiError(
        400,
        "tool_choice: must be 'none', 'auto', 'required', {'type': 'function', 'name': ...},"
        " {'type': 'custom', 'name': ...} or"
        " {'type': 'allowed_tools', 'mode': ..., 'tools': [...]}",
        param="tool_choice",
    )
