"""The model names a server answers to: its served names and aliases (globs like `claude-*`).

Agent harnesses ask for the names they know: Claude Code for `claude-sonnet-4-5-20250929` and
`claude-haiku-4-5`, Codex CLI for `gpt-5-codex`. One model is served here, so a request naming
any accepted name is served by it, and its response's `model` echoes the name the request used
(what the Anthropic API, LiteLLM and vLLM's current servers do; vLLM first reported its first
served name, then changed to the requested one).

Decisions:
- `--served-model-name a b c` (vLLM's flag): concrete names, all listed by `GET /v1/models`;
  the first is the primary name (banners, batch errors, "this server serves ..."). An entry
  with a glob character (`*`, `?`, `[`) is an alias pattern instead.
- `--model-alias PATTERN ...`: more accepted names or globs (fnmatch, case-sensitive); a
  concrete alias is listed too, a pattern never (no client can use a listed glob).
- With neither flag, any model name is accepted (the alias `*`): one model is served, and a
  harness should work unchanged, whatever name it sends. Naming the model (either flag) makes
  the set explicit: other names get 404 model_not_found, as vLLM does; `--model-alias '*'`
  keeps any name accepted besides a chosen served name.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

ANY_NAME = "*"
GLOB_CHARACTERS = frozenset("*?[")
MAX_NAME_LENGTH = 256


def is_pattern(name: str) -> bool:
    return not GLOB_CHARACTERS.isdisjoint(name)


def check_name(text: str) -> str:
    """A model name or glob as given on the command line; ValueError says what is wrong."""
    if not text:
        raise ValueError("a model name cannot be empty")
    if len(text) > MAX_NAME_LENGTH:
        raise ValueError(f"a model name is at most {MAX_NAME_LENGTH} characters")
    if any(c.isspace() or not c.isprintable() for c in text):
        raise ValueError(f"{text!r}: a model name has no spaces or control characters")
    if _unclosed_class(text):
        # fnmatch would read an unclosed '[' literally: refused, since it reads as a mistake
        raise ValueError(f"{text!r}: a '[' character class must close with ']'")
    return text


def _unclosed_class(text: str) -> bool:
    depth = 0
    for c in text:
        if c == "[":
            if depth:
                return True  # nested: fnmatch has no such thing
            depth = 1
        elif c == "]" and depth:
            depth = 0
    return depth > 0


@dataclass(frozen=True, slots=True)
class ModelNames:
    """The served names (first: the primary) and the alias names and patterns accepted."""

    served: tuple[str, ...]
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.served or any(is_pattern(name) for name in self.served):
            raise ValueError("ModelNames.served: one or more concrete names")

    @classmethod
    def from_flags(
        cls, default: str, served: list[str] | None, aliases: list[str] | None
    ) -> ModelNames:
        """What `--served-model-name` and `--model-alias` give, `default` (the checkpoint's
        name) when no concrete name is served; neither flag: any name (see the module)."""
        given = list(served or [])
        concrete = [name for name in given if not is_pattern(name)]
        patterns = [name for name in given if is_pattern(name)] + list(aliases or [])
        if not given and aliases is None:
            patterns = [ANY_NAME]
        return cls(_unique(concrete or [default]), _unique(patterns))

    @property
    def primary(self) -> str:
        return self.served[0]

    @property
    def any_name(self) -> bool:
        return ANY_NAME in self.aliases

    def accepts(self, name: str) -> bool:
        if name in self.served:
            return True
        return any(fnmatchcase(name, alias) for alias in self.aliases)

    def listed(self) -> tuple[str, ...]:
        """The names `GET /v1/models` lists: served names, then concrete aliases."""
        return _unique([*self.served, *(a for a in self.aliases if not is_pattern(a))])


def _unique(names: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))
