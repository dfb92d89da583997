"""System turns keep their place: a mid-conversation system message is rendered where it was
sent, as the chat template allows, never moved to the front.

Clients send system text mid-conversation (OpenAI `system`/`developer` messages, Anthropic's
`role: "system"` messages, agent reminders after tool results). Moving it into the leading
system prompt would change the prompt's prefix every turn and defeat the prefix cache, so the
leading system prompt stays byte-identical turn after turn and each later system message is
rendered at its position (`in_place`), by what the template does with system turns
(`system_support`, a probe rendered once per template):

- "anywhere": the template renders a system turn at any position: every turn as it is.
- "first": only a leading one (a later one raises, as Mistral's does, or is dropped or moved
  by the template itself): the leading system turns are joined into one, and each later one
  becomes a user-side note at its position, `<system-reminder>` text (as Claude Code wraps
  its reminders) joined to the user turn before it, else to the user turn after it, else a
  user turn of its own (strict-alternation templates refuse two user turns in a row).
- "none": no system role at all (Gemma's raises): the leading system text opens the first
  user turn (as Gemma 3's own template folds it), later ones are notes as under "first".
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from zerohop.api.conversation.request import Turn
from zerohop.engine.base.errors import InvalidRequestError

SystemSupport = Literal["anywhere", "first", "none"]
_LEADING_PROBE = "zerohop-leading-system-probe"
_LATE_PROBE = "zerohop-late-system-probe"
_SUPPORT: dict[str, SystemSupport] = {}  # chat template -> what it does with system turns


class ChatRenderer(Protocol):
    @property
    def chat_template(self) -> str | None: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str: ...


def system_support(tokenizer: ChatRenderer) -> SystemSupport:
    """Where the chat template renders system turns (module docstring), probed once per
    template; no template: "anywhere" (no prompt can be rendered: the planner says so)."""
    template = tokenizer.chat_template
    if template is None:
        return "anywhere"
    if template not in _SUPPORT:
        _SUPPORT[template] = _probe(tokenizer)
    return _SUPPORT[template]


def _probe(tokenizer: ChatRenderer) -> SystemSupport:
    leading = {"role": "system", "content": _LEADING_PROBE}
    late = {"role": "system", "content": _LATE_PROBE}
    user, answer, again = _said("user", "a1"), _said("assistant", "b2"), _said("user", "c3")
    order = [_LEADING_PROBE, "a1", "b2", _LATE_PROBE, "c3"]
    if _in_order(_render(tokenizer, [leading, user, answer, late, again]), order):
        return "anywhere"
    if _in_order(_render(tokenizer, [leading, user]), order[:2]):
        return "first"
    return "none"


def _said(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "content": text}


def _render(tokenizer: ChatRenderer, messages: list[dict[str, Any]]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except InvalidRequestError:
        return ""


def _in_order(rendered: str, texts: list[str]) -> bool:
    """Whether each text appears in `rendered`, each after the one before."""
    at = 0
    for text in texts:
        at = rendered.find(text, at)
        if at < 0:
            return False
    return True


def note(text: str) -> str:
    """A later system message as user-side text."""
    return f"<system-reminder>\n{text}\n</system-reminder>"


def in_place(messages: list[dict[str, Any]], support: SystemSupport) -> list[dict[str, Any]]:
    """The chat-template messages with their system ones rendered as `support` allows
    (module docstring): the leading ones first, every later one at its own position."""
    if support == "anywhere":
        return messages
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    leading = "\n\n".join(str(m.get("content") or "") for m in messages[:lead])
    out: list[dict[str, Any]] = []
    if leading and support == "first":
        out.append({"role": "system", "content": leading})
    pending = leading if leading and support == "none" else ""  # opens the next user turn
    for message in messages[lead:]:
        if message["role"] == "system":
            text = note(str(message.get("content") or ""))
            if out and out[-1]["role"] == "user" and not pending:
                out[-1] = _joined(out[-1], text, after=True)
            else:
                pending = f"{pending}\n\n{text}" if pending else text
            continue
        if pending and message["role"] == "user":
            message, pending = _joined(message, pending, after=False), ""
        elif pending:
            out.append({"role": "user", "content": pending})
            pending = ""
        out.append(message)
    if pending:
        out.append({"role": "user", "content": pending})
    return out


def _joined(message: dict[str, Any], text: str, after: bool) -> dict[str, Any]:
    content = str(message.get("content") or "")
    parts = [content, text] if after else [text, content]
    return {**message, "content": "\n\n".join(p for p in parts if p)}


def append_turn(turns: list[Turn], turn: Turn) -> None:
    """Add a turn, joining it to the previous one of the same role with a blank line."""
    last = turns[-1] if turns else None
    if last is None or last.role != turn.role or turn.role == "tool":
        turns.append(turn)
        return
    last.text += ("\n\n" if last.text and turn.text else "") + turn.text
    last.calls += turn.calls
