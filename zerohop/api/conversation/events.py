"""The engine's output of one choice as neutral events, read piece by piece.

`OutputReader` splits a reasoning model's thought from its answer (reasoning.py) and reads
the answer's tool calls in the request's format (tools/parsers.py): a forced call streamed as
it is decoded (its name once read, then its arguments' text), any other call once whole and
valid for its tool's schema. Every surface encodes these events into its own wire shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zerohop.api.conversation.reasoning import ReasoningParser
from zerohop.api.tools.hermes import Parsed
from zerohop.api.tools.parsers import ToolParser
from zerohop.api.tools.spec import ToolCall


@dataclass(slots=True)
class Thought:
    text: str


@dataclass(slots=True)
class ThoughtEnd:
    """The thought is over (closed by the model or the budget, or the output ended)."""


@dataclass(slots=True)
class Text:
    text: str


@dataclass(slots=True)
class CallStart:
    """A call streamed as it is decoded: its tool's name is read; arguments follow."""

    index: int
    name: str


@dataclass(slots=True)
class CallArguments:
    """More of a streamed call's arguments, as JSON text decoded so far."""

    index: int
    fragment: str


@dataclass(slots=True)
class CallEnd:
    """A call is complete: `streamed` when CallStart/CallArguments carried it already."""

    index: int
    call: ToolCall
    streamed: bool


Event = Thought | ThoughtEnd | Text | CallStart | CallArguments | CallEnd


@dataclass(slots=True)
class OutputReader:
    """One choice's output. `thoughts`: None when nothing is split off as a thought; `calls`:
    None when no call is parsed; `single`: the first call only, later ones dropped."""

    thoughts: ReasoningParser | None = None
    calls: ToolParser | None = None
    single: bool = False
    thought_ended: bool = False
    count: int = 0  # calls given out
    open: int | None = None  # the index of the call being streamed
    thought: str = ""  # the whole thought so far
    found: list[ToolCall] = field(default_factory=list)  # every call given out

    def feed(self, piece: str, final: bool = False) -> list[Event]:
        events: list[Event] = []
        answer = piece
        if self.thoughts is not None:
            thought, answer = self.thoughts.feed(piece, final)
            if thought:
                self.thought += thought
                events.append(Thought(thought))
            if not self.thought_ended and (self.thoughts.thought_done or final):
                self.thought_ended = True
                events.append(ThoughtEnd())
            if not self.thought_ended:
                return events
        if self.calls is None:
            return [*events, Text(answer)] if answer else events
        return events + self._answer(self._parsed(answer, final))

    @property
    def thought_opened(self) -> bool:
        """Whether the output had a thought (even an empty one)."""
        return self.thoughts is not None and self.thoughts.opened

    def _parsed(self, answer: str, final: bool) -> Parsed:
        assert self.calls is not None
        parsed = self.calls.feed(answer)
        if final:
            rest = self.calls.finish()
            parsed.text, parsed.calls = parsed.text + rest.text, parsed.calls + rest.calls
        return parsed

    def _answer(self, parsed: Parsed) -> list[Event]:
        events: list[Event] = [Text(parsed.text)] if parsed.text else []
        if parsed.opened is not None and self._room():
            self.open = self.count
            events.append(CallStart(self.count, parsed.opened))
        if parsed.fragment and self.open is not None:
            events.append(CallArguments(self.open, parsed.fragment))
        for call in parsed.calls:
            if self.open is not None:
                events.append(CallEnd(self.open, call, streamed=True))
                self.open = None
            elif self._room():
                events.append(CallEnd(self.count, call, streamed=False))
            else:
                continue
            self.found.append(call)
            self.count += 1
        return events

    def _room(self) -> bool:
        return not (self.single and self.count)
