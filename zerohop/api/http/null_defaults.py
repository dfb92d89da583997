"""Request Structs whose explicit JSON `null` means "as if absent", as the OpenAI and
Anthropic APIs treat it: `"max_tokens": null` on a completion is its default 16, not
"no limit".

A field that has a default and is typed `T | None` decodes `null` to None; `NullMeansDefault`
then puts the field's default back when that default is not None. Required fields stay
required: a null there is refused like an absent field.
"""

from __future__ import annotations

from typing import Any

import msgspec

_NOT_NONE_DEFAULTS: dict[type, tuple[tuple[str, Any], ...]] = {}


class NullMeansDefault(msgspec.Struct):
    def __post_init__(self) -> None:
        for name, default in _not_none_defaults(type(self)):
            if getattr(self, name) is None:
                setattr(self, name, default)


def _not_none_defaults(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, default) of the fields whose default is a value other than None."""
    found = _NOT_NONE_DEFAULTS.get(cls)
    if found is None:
        found = tuple(
            (field.name, field.default)
            for field in msgspec.structs.fields(cls)
            if field.default is not msgspec.NODEFAULT and field.default is not None
        )
        _NOT_NONE_DEFAULTS[cls] = found
    return found
