"""The JSON schema of one Hermes call object, `{"name": <the tool>, "arguments": <its
arguments>}`, built from the tool's own argument schema.

The tool's schema moves from a document's root to the call's `arguments`, so references
relative to its root (`#/$defs/Unit`, `#/definitions/Unit`, `#`, `#/properties/...`: what
every Pydantic model with a nested model or an Enum writes) would point at the wrong place.
Its definitions are therefore lifted to the call schema's root, under names that carry the
tool's (two tools may both define `Unit`), and each reference is rewritten to match; a
reference to the root itself, or into it, goes through a definition holding the whole
argument schema.
"""

from __future__ import annotations

from typing import Any

from zerohop.api.tools.spec import Tool

_DEFINITIONS = ("$defs", "definitions")
_ROOT_ONLY = ("$schema", "$id")  # meaningful only at a document's root


def call_schema(tool: Tool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the call object's schema, the definitions it refers to, for the document's root
    `$defs`)."""
    prefix = f"{tool.name}__"
    rewrite = _Rewrite(prefix)
    arguments = {k: v for k, v in tool.parameters.items() if k not in _DEFINITIONS + _ROOT_ONLY}
    definitions = {
        prefix + name: rewrite.schema(sub)
        for key in _DEFINITIONS
        if isinstance(tool.parameters.get(key), dict)
        for name, sub in tool.parameters[key].items()
    }
    arguments = rewrite.schema(arguments)
    if rewrite.root_used:
        definitions[rewrite.root] = arguments
        arguments = {"$ref": f"#/$defs/{rewrite.root}"}
    schema = {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    return schema, definitions


class _Rewrite:
    """Rewrites a tool schema's root-relative references for their new place."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.root = prefix.removesuffix("__")  # no definition's name: each has the prefix
        self.root_used = False

    def schema(self, node: Any) -> Any:
        if isinstance(node, list):
            return [self.schema(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {key: self.schema(value) for key, value in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = self.reference(ref)
        return out

    def reference(self, ref: str) -> str:
        for key in _DEFINITIONS:
            start = f"#/{key}/"
            if ref.startswith(start):
                return "#/$defs/" + self.prefix + ref.removeprefix(start)
        self.root_used = True
        return f"#/$defs/{self.root}" + ref.removeprefix("#")
