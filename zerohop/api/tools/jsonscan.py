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
    end = ValueScanner().feed(text[start:] if start else text)
    return end + start if end >= 0 else end


class ValueScanner:
    """`value_end` fed piece by piece: a streamed value's end is found in time linear in
    its length, not rescanned from its start at every token."""

    def __init__(self) -> None:
        self._stack: list[str] = []
        self._in_string = self._escaped = self._started = False

    def feed(self, text: str) -> int:
        """The index in `text` just past the value's end, INCOMPLETE or INVALID. The first
        piece must begin with the value's bracket."""
        for i, c in enumerate(text):
            if self._in_string:
                self._escaped, self._in_string = (
                    (False, True) if self._escaped else (c == "\\", c != '"')
                )
            elif not self._started and c not in _PAIRS:
                return INVALID
            elif c == '"':
                self._in_string = True
            elif c in _PAIRS:
                self._started = True
                self._stack.append(_PAIRS[c])
            elif c in "}]":
                if c != self._stack.pop():
                    return INVALID
                if not self._stack:
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
