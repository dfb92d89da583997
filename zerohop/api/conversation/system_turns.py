"""Turn-list rules two surfaces share: joining a turn to the one before it of the same role,
and system turns after the first user turn, which not every chat template renders.

When the chat template does not render a system turn after the first user turn (it raises,
as Mistral's and Gemma's do, or drops it; `takes_late_system` renders a probe once per
template), every system turn is merged into the leading one instead, in order, joined with a
blank line (`leading_system`).
"""

from __future__ import annotations

from typing import Any, Protocol

from zerohop.api.conversation.request import Turn
from zerohop.engine.base.errors import InvalidRequestError

_LATE_SYSTEM_PROBE = "zerohop-late-system-probe"
_LATE_SYSTEM: dict[str, bool] = {}  # chat template -> takes_late_system


class ChatRenderer(Protocol):
    @property
    def chat_template(self) -> str | None: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str: ...


def takes_late_system(tokenizer: ChatRenderer) -> bool:
    """Whether the chat template renders a system turn after a user turn (rendered once per
    template): it must neither raise nor drop it."""
    template = tokenizer.chat_template
    if template is None:
        return True  # no prompt can be rendered: the planner says so
    if template not in _LATE_SYSTEM:
        probe = [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "system", "content": _LATE_SYSTEM_PROBE},
            {"role": "user", "content": "c"},
        ]
        try:
            rendered = tokenizer.apply_chat_template(probe, add_generation_prompt=True)
        except InvalidRequestError:
            rendered = ""
        _LATE_SYSTEM[template] = _LATE_SYSTEM_PROBE in rendered
    return _LATE_SYSTEM[template]


def leading_system(turns: list[Turn]) -> list[Turn]:
    """The turns with every system turn merged into one leading system turn."""
    text = "\n\n".join(t.text for t in turns if t.role == "system")
    merged = [Turn("system", text)] if text else []
    for turn in turns:
        if turn.role != "system":
            append_turn(merged, turn)
    return merged


def append_turn(turns: list[Turn], turn: Turn) -> None:
    """Add a turn, joining it to the previous one of the same role with a blank line."""
    last = turns[-1] if turns else None
    if last is None or last.role != turn.role or turn.role == "tool":
        turns.append(turn)
        return
    last.text += ("\n\n" if last.text and turn.text else "") + turn.text
    last.calls += turn.calls
