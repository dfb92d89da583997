"""Reasoning (thinking) output: which models have a reasoning format, and splitting their
output into the thought and the answer (thoughts are signed in thought_signatures.py).

- A model has a reasoning format when its chat template mentions `<think>` (Qwen3 and the
  like); `enable_thinking` is the template variable that turns the thought on or off.
- The output is `<think>thought</think>answer`; when the generation prompt already opened
  `<think>` (templates that force the thought), the output starts inside the thought.
  Whitespace at the start of the thought and of the answer is dropped.
"""

from __future__ import annotations

from typing import Protocol

from zerohop.api.tools.jsonscan import partial_tag
from zerohop.engine.sample.thought_budget import THOUGHT_CLOSE, THOUGHT_OPEN

OPEN, CLOSE = THOUGHT_OPEN, THOUGHT_CLOSE
TAIL_TOKENS = 8


def has_reasoning_format(chat_template: str | None) -> bool:
    return chat_template is not None and OPEN in chat_template


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def opens_thought(tokenizer: Decoder, prompt: list[int]) -> bool:
    """Whether a prompt ends inside an opened `<think>` (the output is the thought); its
    last few tokens hold the tag and the whitespace after it."""
    tail = tokenizer.decode(prompt[-TAIL_TOKENS:], skip_special_tokens=False)
    return tail.rstrip().endswith(OPEN)


class ReasoningParser:
    """Splits output, fed piece by piece, into (thought, answer) text; partial tags are held
    back until they are decided. After `</think>` all is answer."""

    def __init__(self, in_thought: bool = False) -> None:
        self.state = "thought_lead" if in_thought else "start"
        self.buffer = ""
        self.thought_done = False  # `</think>` seen (or the output had no thought)
        self.opened = in_thought  # the output has a thought (`<think>` seen or prompted)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buffer += text
        reasoning, content = "", ""
        while self.buffer:
            step = getattr(self, "_" + self.state)(final)
            if step is None:
                break
            reasoning, content = reasoning + step[0], content + step[1]
        return reasoning, content

    def _start(self, final: bool) -> tuple[str, str] | None:
        stripped = self.buffer.lstrip()
        if stripped.startswith(OPEN):
            self.buffer, self.state = stripped[len(OPEN) :], "thought_lead"
            self.opened = True
            return "", ""
        if (not stripped or OPEN.startswith(stripped)) and not final:
            return None
        self.state, self.thought_done = "answer_lead", True
        return "", ""

    def _thought_lead(self, final: bool) -> tuple[str, str] | None:
        return self._lead("thought", final)

    def _thought(self, final: bool) -> tuple[str, str] | None:
        end = self.buffer.find(CLOSE)
        if end >= 0:
            thought, self.buffer = self.buffer[:end], self.buffer[end + len(CLOSE) :]
            self.state, self.thought_done = "answer_lead", True
            return thought, ""
        keep = 0 if final else partial_tag(self.buffer, CLOSE)
        thought = self.buffer[: len(self.buffer) - keep]
        self.buffer = self.buffer[len(thought) :]
        return (thought, "") if thought else None

    def _answer_lead(self, final: bool) -> tuple[str, str] | None:
        return self._lead("answer", final)

    def _lead(self, then: str, final: bool) -> tuple[str, str] | None:
        """Drops the whitespace that begins the thought or the answer."""
        self.buffer = self.buffer.lstrip()
        if not self.buffer and not final:
            return None
        self.state = then
        return "", ""

    def _answer(self, final: bool) -> tuple[str, str] | None:
        content, self.buffer = self.buffer, ""
        return "", content
