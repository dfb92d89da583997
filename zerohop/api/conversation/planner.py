"""The planner: one `Conversation` into the engine request, the same rules on every surface.

- The prompt is the chat template's rendering of the turns (tools through the template's
  `tools` variable or tools/prompt.py's Hermes fallback), with `enable_thinking` when the
  request says whether to think and the model has a reasoning format, followed by the
  prefill (the answer continues it). With `render_thoughts`, the assistant turns of the
  current tool loop (those after the last user turn) carry their thought as
  `reasoning_content`, which Qwen3-style templates render for those turns (and leave out
  for earlier ones, whose thoughts are not passed). System turns keep their place, rendered
  as the template allows (system_turns.py), so a session's prompt prefix is stable.
- The grammar: a forced call's (required: any tool, named: that tool; streamed as it is
  decoded), else the output format's, else, in auto mode with only strict tools read as
  Hermes and no thought asked for nor prefill, free text whose calls follow the tools'
  schemas. With an answer format and tools (forced, or auto read as Hermes), the grammar is
  the union: the call(s), or else the answer in the format (agent frameworks send both: a
  tool to call or the final answer's schema); a raw-output constraint (vLLM's
  structured_outputs, gRPC's constraint) is kept whole under auto and refused with a forced
  call. A forced call refuses a prefill.
- A thought is split off the answer when the model has a reasoning format, the request does
  not say not to think, and the output is not constrained by a forced call or an output
  format: a constrained output is written by its grammar from the first token, so it has no
  thought. Whichever the surface, asking for a thought (thinking on, or a thinking budget)
  together with a forced call or an output format is therefore a 400, and a thought the
  model would only have written on its own is skipped.
- Calls are parsed unless tool choice is none; with `parallel` off, the first call only.
- A forced call of a raw-input tool (`raw_call`, tools/raw_input.py) is the whole output:
  its grammar is the tool's (free text without one), and it is read as that call's input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from zerohop.api.conversation.events import OutputReader
from zerohop.api.conversation.reasoning import (
    ReasoningParser,
    has_reasoning_format,
    opens_thought,
)
from zerohop.api.conversation.request import Conversation
from zerohop.api.conversation.system_turns import ChatRenderer, in_place, system_support
from zerohop.api.errors import ApiError
from zerohop.api.serving.service import ServingContext
from zerohop.api.tools.forced import (
    auto_call_grammar,
    call_or_answer_grammar,
    forced_call_grammar,
)
from zerohop.api.tools.forced_stream import ForcedCallParser
from zerohop.api.tools.hermes import HermesParser
from zerohop.api.tools.parsers import ParserFactory
from zerohop.api.tools.prompt import render_messages
from zerohop.api.tools.raw_input import raw_input_parser
from zerohop.api.tools.spec import Tool, ToolSet
from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.sample.sampling_params import SamplingParams


@dataclass(slots=True)
class Plan:
    """What the engine runs and how its output is read back."""

    prompt: list[int]
    params: SamplingParams
    in_thought: bool | None  # None: no thought is split off; else the output starts in one
    parser: ParserFactory | None  # None: calls are not parsed
    tools: ToolSet
    single: bool = False
    forced: bool = False

    def reader(self) -> OutputReader:
        """A reader for one choice of the output."""
        thoughts = None if self.in_thought is None else ReasoningParser(self.in_thought)
        calls = None if self.parser is None else self.parser(self.tools)
        return OutputReader(thoughts, calls, self.single)

    def readers(self) -> Callable[[], OutputReader] | None:
        """How each choice's output is read; None when it is plain text (no thought is split
        off, no call is parsed)."""
        if self.parser is None and self.in_thought is None:
            return None
        return self.reader


def plan(
    conv: Conversation,
    ctx: ServingContext,
    params: SamplingParams,
    continues: list[int] | None = None,
) -> Plan:
    """The engine request of `conv`; `params`: the surface's sampling parameters (no grammar),
    `continues`: tokens a failed-over stream already produced (service.continued)."""
    asked = prompt_ids(conv, ctx)
    prompt = ctx.continued(asked, continues)
    if conv.raw_call is not None:
        return _raw_call_plan(conv, ctx, params, prompt)
    constrained = constrained_grammar(conv, ctx.tool_parser)
    in_thought = _thought_start(conv, ctx, asked, constrained)  # where the answer starts
    params = replace(params, grammar=constrained or strict_grammar(conv, ctx.tool_parser))
    budget = conv.reasoning.budget
    if budget is not None and in_thought is not None:
        params = replace(params, thinking_budget=budget, thought_open=in_thought)
    choice = conv.tool_choice
    parser = call_parser(conv, ctx.tool_parser)
    tools = ToolSet(conv.tools)
    return Plan(prompt, params, in_thought, parser, tools, not choice.parallel, choice.forced)


def _raw_call_plan(
    conv: Conversation, ctx: ServingContext, params: SamplingParams, prompt: list[int]
) -> Plan:
    raw = conv.raw_call
    assert raw is not None
    if conv.prefill is not None:
        raise ApiError(400, "tool_choice: a forced tool call cannot continue a prefill")
    if conv.output_grammar is not None:
        raise ApiError(
            400,
            f"tool_choice: a forced custom tool call cannot be combined with {conv.output_field}",
            param="tool_choice",
        )
    _thought_start(conv, ctx, prompt, raw.grammar or "")  # a thought asked for: the 400
    params = replace(params, grammar=raw.grammar)
    parser = raw_input_parser(raw.name)
    return Plan(prompt, params, None, parser, ToolSet(conv.tools), single=True, forced=True)


def grammar(conv: Conversation, parser: ParserFactory) -> str | None:
    """The grammar the output is decoded by (see the module docstring), or None."""
    return constrained_grammar(conv, parser) or strict_grammar(conv, parser)


def constrained_grammar(conv: Conversation, parser: ParserFactory) -> str | None:
    """The grammar of a forced call or an output format (with tools in auto mode read as
    Hermes: a call or else the answer in the format), or None."""
    if conv.tool_choice.forced:
        return forced_grammar(conv)
    if conv.output_grammar is None:
        return None
    tools = conv.tools
    if conv.tool_choice.mode != "auto" or not tools or not conv.output_is_answer:
        return conv.output_grammar
    if parser is not HermesParser or conv.prefill is not None:
        return conv.output_grammar
    try:
        return call_or_answer_grammar(tools, conv.output_grammar, conv.tool_choice.parallel)
    except InvalidRequestError as exc:
        if any(t.strict for t in tools):
            raise ApiError(400, f"tools: {exc}", param="tools") from None
        return conv.output_grammar  # loose tools' schemas: their calls validated, not decoded


def call_parser(conv: Conversation, default: ParserFactory) -> ParserFactory | None:
    """How calls are read: a forced one as Hermes, as it is decoded; others in the model's
    format (`default`); None when no call is parsed."""
    if not conv.tools or conv.tool_choice.mode == "none":
        return None
    return ForcedCallParser if conv.tool_choice.forced else default


def prompt_ids(conv: Conversation, ctx: ServingContext) -> list[int]:
    """The prompt's tokens (count_tokens counts these)."""
    turns, extra = chat_messages(conv, ctx.tokenizer)
    if conv.prefill is None:
        return ctx.encode_chat(turns, **extra)
    tokenizer = ctx.tokenizer
    try:
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, **extra)
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param="messages") from exc
    return tokenizer.encode(text + conv.prefill, add_special_tokens=False)


def chat_messages(
    conv: Conversation, tokenizer: ChatRenderer
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and variables the chat template renders the prompt from: tools as the
    template takes them, system turns where they were sent (system_turns.in_place)."""
    turns = template_turns(conv)
    extra = dict(conv.template_kwargs)
    template = tokenizer.chat_template
    if conv.tools or conv.has_tool_turns:
        turns, variables = render_messages(turns, conv.tools, template)
        extra.update(variables)
    if conv.reasoning.think is not None and has_reasoning_format(template):
        extra["enable_thinking"] = conv.reasoning.think
    return in_place(turns, system_support(tokenizer)), extra


def template_turns(conv: Conversation) -> list[dict[str, Any]]:
    """The turns as the chat template takes them; with `render_thoughts`, the current tool
    loop's with their thoughts (module docstring)."""
    turns = conv.turns
    loop = len(turns)
    if conv.render_thoughts:
        users = [i for i, turn in enumerate(turns) if turn.role == "user"]
        loop = users[-1] + 1 if users else len(turns)  # no user turn: no tool loop
    return [turn.as_template(i >= loop) for i, turn in enumerate(turns)]


def forced_grammar(conv: Conversation) -> str | None:
    """The grammar of exactly one call when tool choice is required or named, else None."""
    choice = conv.tool_choice
    if not choice.forced:
        return None
    chosen = _chosen(conv.tools, choice.name)
    if conv.prefill is not None:
        raise ApiError(400, "tool_choice: a forced tool call cannot continue a prefill")
    answer = conv.output_grammar
    if answer is None:
        return _tool_grammar(forced_call_grammar, chosen)
    if not conv.output_is_answer:
        raise ApiError(
            400,
            f"tool_choice: a forced tool call cannot be combined with {conv.output_field}",
            param="tool_choice",
        )
    return _tool_grammar(lambda tools: call_or_answer_grammar(tools, answer, False), chosen)


def _tool_grammar(build: Callable[[list[Tool]], str], tools: list[Tool]) -> str:
    """`build(tools)`, a tool schema the grammar backend cannot compile answered 400."""
    try:
        return build(tools)
    except InvalidRequestError as exc:
        raise ApiError(400, f"tools: {exc}", param="tools") from None


def _chosen(tools: list[Tool], name: str | None) -> list[Tool]:
    if not tools:
        raise ApiError(400, "tool_choice: forcing a call requires tools", param="tool_choice")
    if name is None:
        return tools
    chosen = [t for t in tools if t.name == name]
    if not chosen:
        raise ApiError(400, f"tool_choice: no tool named {name!r} in tools", param="tool_choice")
    return chosen


def strict_grammar(conv: Conversation, parser: ParserFactory) -> str | None:
    """In auto mode with only strict tools, free text whose calls follow the tools' schemas
    (forced.auto_call_grammar): only when calls are read as Hermes (the format it writes),
    and not with a prefill or a thought asked for (each is decoded freely, its calls
    validated)."""
    tools = conv.tools
    if conv.tool_choice.mode != "auto" or not tools or not all(t.strict for t in tools):
        return None
    if parser is not HermesParser or conv.prefill is not None or conv.reasoning.think:
        return None
    return _tool_grammar(auto_call_grammar, tools)


def _thought_start(
    conv: Conversation, ctx: ServingContext, prompt: list[int], constrained: str | None
) -> bool | None:
    """None: no thought is split off (see the module docstring); else whether the output
    starts inside the thought (the prompt opened it)."""
    reasoning = has_reasoning_format(ctx.tokenizer.chat_template)
    if conv.reasoning.budget is not None and not reasoning:
        raise ApiError(
            400,
            f"{conv.reasoning.budget_field}: the model has no reasoning format (no <think> in"
            " its chat template)",
            param=conv.reasoning.budget_field,
        )
    asked = conv.reasoning.think or conv.reasoning.budget is not None
    if constrained is not None and asked:
        field = "thinking" if conv.reasoning.think else conv.reasoning.budget_field
        raise ApiError(
            400,
            f"{field}: may not be enabled with a forced tool call or {conv.output_field}",
            param=field,
        )
    if not reasoning or constrained is not None or conv.reasoning.think is False:
        return None
    return opens_thought(ctx.tokenizer, prompt)
