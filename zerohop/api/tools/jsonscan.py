"""Where a JSON object or list that begins a piece of text ends, told apart incrementally:
brackets are counted outside strings, so the end is known as soon as it is decoded."""

from __future__ import annotations

import json
from typing import Any

_PAIRS = {"{": "}", "[": "]"}
INCOMPLETE = -1  # the value may still end in text yet to come
INVALID = -2  # the text cannot begin a JSON object or list


def value_end(text: str, start: int = 0) -> int:
    """The index just past the object or list at `text[start]`, INCOMPLETE or INVALID."""
    if text[start] not in _PAIRS:
        return INVALID
    stack: list[str] = []
    in_string = escaped = False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c in _PAIRS:
            stack.append(_PAIRS[c])
        elif c in "}]":
            if c != stack.pop():
                return INVALID
            if not stack:
                return i + 1
    return INCOMPLETE


def loads(text: str) -> Any | None:
    """The JSON value of `text`, or None when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def partial_tag(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
