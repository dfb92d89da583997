"""`text.format` of a Responses request as the answer's grammar: `text` (none), `json_object`,
or `json_schema` with its `name`, `schema`, `strict` and `description` at the format's own
level (the Responses shape; Chat Completions nests them under `json_schema`); and as the
response echoes it: a `json_schema` format with every field the Open Responses spec requires
(`description` null when absent, `strict` true when absent: the answer follows the schema
here whatever `strict` says, the schema being its grammar)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from zerohop.api.errors import ApiError
from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.structured import grammar as g

FIELD = "text.format"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def text_grammar(fmt: dict[str, Any] | None) -> str | None:
    """The grammar of `text.format`; None for text (or no format)."""
    kind = (fmt or {}).get("type", "text")
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return _compiled(g.json_object_grammar)
    if kind != "json_schema":
        raise ApiError(
            400,
            f"{FIELD}.type: {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'",
            param=FIELD,
        )
    name, schema = fmt.get("name"), fmt.get("schema")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ApiError(
            400, f"{FIELD}.name: must be 1 to 64 letters, digits, '_' or '-'", param=f"{FIELD}.name"
        )
    if not isinstance(schema, dict):
        raise ApiError(
            400, f"Missing required parameter: '{FIELD}.schema'.", param=f"{FIELD}.schema"
        )
    return _compiled(lambda: g.json_schema_grammar(schema))


def echoed_format(fmt: dict[str, Any] | None) -> dict[str, Any]:
    """`text.format` as the response object echoes it (module docstring)."""
    if not fmt:
        return {"type": "text"}
    if fmt.get("type") != "json_schema":
        return fmt
    return {"description": None, **fmt, "strict": fmt.get("strict") is not False}


def _compiled(build: Callable[[], str]) -> str:
    try:
        return build()
    except InvalidRequestError as exc:
        raise ApiError(400, f"{FIELD}: {exc}", param=FIELD) from None
