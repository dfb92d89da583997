"""A thinking budget: the thought (`<think>` ... `</think>`, Qwen3's reasoning format) ends
by force once it has `thinking_budget` tokens, as Anthropic's `budget_tokens` asks and
vLLM's thinking-budget processor does: the next tokens are the closing tag's, then the
model answers.

The tags are read as the model's tokenizer encodes them. A model that writes the closing
tag in other tokens than those (a BPE merging it with the text before) is not seen to close
its thought; it is then closed again when the budget is spent. A thought opens where the
prompt ends (`thought_open`) or at the output's start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

THOUGHT_OPEN, THOUGHT_CLOSE = "<think>", "</think>"
# A thought opens at the output's start: its tag may follow this many tokens (whitespace),
# not more; a `<think>` later in the answer is text (as api/conversation/reasoning.py reads it).
OPENING_LEAD = 4


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(slots=True, frozen=True)
class ThoughtTags:
    """The token ids of the opening and closing tags."""

    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: Encoder) -> ThoughtTags:
        def ids(tag: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(tag, add_special_tokens=False))

        return cls(ids(THOUGHT_OPEN), ids(THOUGHT_CLOSE))


@dataclass(slots=True)
class ThoughtBudget:
    """One request's thought, read a token at a time: open, how much of the budget it has
    spent, and how far the forced closing tag has got."""

    budget: int
    tags: ThoughtTags
    in_thought: bool = False  # the prompt opened the thought, or the output has
    closed: bool = False  # a thought has ended: the rest is the answer
    spent: int = 0
    forcing: int = -1  # index of the closing tag's next forced token; -1: none
    read: int = 0  # tokens (prompt and output) read so far

    def forced_token(self, token_ids: Sequence[int], num_prompt_tokens: int) -> int | None:
        """The token the next step must take, or None; reads the output not read yet
        (`token_ids` is the prompt and the output)."""
        for i in range(max(self.read, num_prompt_tokens), len(token_ids)):
            self._read_token(token_ids, i, num_prompt_tokens)
        self.read = len(token_ids)
        if self.in_thought and self.forcing < 0 and self.spent >= self.budget:
            self.forcing = 0
        return self.tags.close_ids[self.forcing] if self.forcing >= 0 else None

    def _read_token(self, token_ids: Sequence[int], i: int, first: int) -> None:
        if self.closed:
            return
        if self.forcing >= 0:
            self.forcing += 1
            if self.forcing == len(self.tags.close_ids):
                self._close()
        elif self.in_thought:
            if _ends_with(token_ids, i, first, self.tags.close_ids):
                self._close()
            else:
                self.spent += 1
        elif _ends_with(token_ids, i, first, self.tags.open_ids):
            self.in_thought = True
        elif i - first >= len(self.tags.open_ids) + OPENING_LEAD:
            self.closed = True  # no thought: the output is all answer

    def _close(self) -> None:
        self.in_thought, self.closed, self.forcing = False, True, -1


def _ends_with(token_ids: Sequence[int], i: int, first: int, tag: tuple[int, ...]) -> bool:
    """Whether token_ids[first : i + 1] (output tokens only) ends with `tag`."""
    start = i + 1 - len(tag)
    return bool(tag) and start >= first and tuple(token_ids[start : i + 1]) == tag
