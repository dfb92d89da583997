"""One conversation request, whichever surface it came in on: what each surface decodes into.

A surface maps its wire shapes here and nothing else decides for it: the planner
(planner.py) turns a `Conversation` into the engine request, and the output reader
(events.py) turns the engine's deltas back into neutral events for the surface to encode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from zerohop.api.tools.spec import Tool

Role = Literal["system", "user", "assistant", "tool"]
ChoiceMode = Literal["auto", "none", "required", "named"]


@dataclass(slots=True)
class CallTurn:
    """A tool call an earlier assistant turn made: its arguments a JSON object, or the text an
    answer left that is not one (a call cut off by max_tokens, replayed as it came)."""

    name: str
    arguments: dict[str, Any] | str


def call_arguments(given: Any) -> dict[str, Any] | str:
    """An earlier call's arguments as an OpenAI surface carries them (a JSON string): the
    object, or the text itself where it is not a JSON object. Never an error: the APIs take
    back whatever arguments a model produced."""
    if isinstance(given, dict):
        return given
    if given is None or (isinstance(given, str) and not given.strip()):
        return {}
    text = given if isinstance(given, str) else json.dumps(given)
    try:
        parsed = json.loads(text)
    except ValueError:
        return text
    return parsed if isinstance(parsed, dict) else text


@dataclass(slots=True)
class Turn:
    """A turn: text, plus an assistant's calls, or a tool result (`tool_name` set)."""

    role: Role
    text: str = ""
    calls: list[CallTurn] = field(default_factory=list)
    tool_name: str | None = None  # role "tool": the tool whose call this answers
    thought: str | None = None  # an assistant turn's thought (verified where it is signed)

    def as_template(self, with_thought: bool = False) -> dict[str, Any]:
        """The turn in tools/prompt.py's neutral message shape; `with_thought`: its thought as
        `reasoning_content`, the field chat templates read it from."""
        if self.role == "tool":
            return {"role": "tool", "content": self.text, "name": self.tool_name}
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        if with_thought and self.thought:
            message["reasoning_content"] = self.thought
        if self.calls:
            message["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in self.calls]
        return message


@dataclass(slots=True)
class ToolChoice:
    """auto: the model may call; none: it may not (nothing is parsed); required: exactly one
    call of any tool; named: exactly one call of `name`. `parallel` False: the first call
    only (Anthropic's disable_parallel_tool_use, OpenAI's parallel_tool_calls: false)."""

    mode: ChoiceMode = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


@dataclass(slots=True, frozen=True)
class RawCall:
    """A forced call of a raw-input tool (tools/raw_input.py): the whole output is its
    input, decoded by `grammar` (None: free text)."""

    name: str
    grammar: str | None = None


@dataclass(slots=True)
class Reasoning:
    """think: True to think, False not to, None as the model and its template decide.
    budget: the most thought tokens (the engine closes the thought at that count)."""

    think: bool | None = None
    budget: int | None = None
    budget_field: str = "thinking.budget_tokens"  # named in the budget's errors


@dataclass(slots=True)
class Conversation:
    """The request: turns (system first), an assistant prefill the answer continues, tools and
    the choice among them, an output format (a grammar, compiled from the surface's own
    format field), reasoning and extra chat-template variables. The sampling fields travel
    beside it, as the surface's `SamplingParams` (planner.plan)."""

    turns: list[Turn]
    prefill: str | None = None
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    output_grammar: str | None = None
    output_field: str = "response_format"  # where the output format came from, for errors
    # The format describes the answer (response_format, output_config.format), so with tools
    # the output is a call or else the answer; False: a constraint on the raw output (vLLM's
    # structured_outputs, gRPC's constraint), which a forced call refuses and auto keeps.
    output_is_answer: bool = True
    raw_call: RawCall | None = None  # set: the output is this tool's raw input, nothing else
    reasoning: Reasoning = field(default_factory=Reasoning)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The thoughts of the current tool loop reach the chat template (planner.prompt_ids):
    # set by a surface whose turns hold only thoughts it verified (anthropic/turns.py).
    render_thoughts: bool = False

    @property
    def has_tool_turns(self) -> bool:
        return any(t.role == "tool" or t.calls for t in self.turns)
