"""A tool definition, checked where it enters: a name, a description and a JSON schema
for its arguments. The surfaces build these from their API's shapes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from zerohop.engine.errors import InvalidRequestError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # both APIs' rule for tool names


@dataclass(slots=True, frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})
    strict: bool = False

    def as_function(self) -> dict[str, Any]:
        """The OpenAI function shape chat templates take as `tools` (transformers' too)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


def checked_tools(tools: list[Tool], where: str = "tools") -> list[Tool]:
    """Refuse bad names, duplicate names and argument schemas that are not objects."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(tool.name, str) or not _NAME.match(tool.name):
            raise InvalidRequestError(
                f"{at}.name: {tool.name!r} must be 1 to 64 letters, digits, '_' or '-'"
            )
        if tool.name in seen:
            raise InvalidRequestError(f"{at}.name: the tool name {tool.name!r} is used twice")
        seen.add(tool.name)
        if not isinstance(tool.parameters, dict):
            raise InvalidRequestError(f"{at}: the argument schema must be a JSON object")
        kind = tool.parameters.get("type", "object")
        if kind != "object":
            raise InvalidRequestError(f"{at}: the argument schema's type must be 'object'")
    return tools


@dataclass(slots=True)
class ToolCall:
    """A call the model made: its tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]
