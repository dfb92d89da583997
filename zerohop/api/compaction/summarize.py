"""The summary of a conversation, written by the served model.

The summarization prompt is the conversation as the request's own prompt renders it, followed
by one user turn asking for the summary: its prefix is the request's, so the prefix cache
already holds it (a session's earlier turns were computed when they were served). The
summary is bounded (`MAX_SUMMARY_TOKENS`, and the room the context leaves), thinking is
turned off, and it runs through the generation driver for the caller's key, under an engine
request id of its own: admitted and charged to its limits and budget as every generation is,
and its tokens added to the request's own audit record, metrics and usage report
(`Call.add_usage`), so a request that compacts is recorded with both its generations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from zerohop.api.conversation.planner import plan
from zerohop.api.conversation.request import Conversation, Reasoning, ToolChoice, Turn
from zerohop.api.conversation.system_turns import append_turn
from zerohop.api.generation.driver import Generation, GenerationRequest
from zerohop.api.generation.events import Usage
from zerohop.api.serving.output_length import Api
from zerohop.api.serving.service import ServingContext, sampling_params
from zerohop.gateway.gateway import Call

MAX_SUMMARY_TOKENS = 1024
PROMPT = (
    "Summarize the conversation so far for a continuation of it: the task and its goal, the"
    " decisions made, the facts and results found (file names, commands, values), what is"
    " done and what is left. Be concise and complete; write the summary only."
)
FRAME = "Summary of the earlier conversation (compacted):\n"


@dataclass(slots=True)
class Summary:
    text: str
    usage: Usage


async def summarize(
    ctx: ServingContext,
    call: Call,
    conv: Conversation,
    api: Api,
    instructions: str | None = None,
) -> Summary:
    """The model's summary of `conv`'s turns (`instructions`: the request's own prompt)."""
    turns = list(conv.turns)
    ask = instructions if instructions and instructions.strip() else PROMPT
    append_turn(turns, Turn("user", ask))
    asked = dataclasses.replace(
        conv,
        turns=turns,
        prefill=None,
        tool_choice=ToolChoice("none"),  # tools stay in the prompt (its prefix); none is called
        output_grammar=None,
        raw_call=None,
        reasoning=Reasoning(think=False),
    )
    params = sampling_params(temperature=0.0, max_tokens=MAX_SUMMARY_TOKENS)
    planned = plan(asked, ctx, params)
    wanted = GenerationRequest(api, planned.prompt, planned.params, planned.readers())
    # An engine request of its own: the answer that follows it runs under the call's id.
    # Charged to the limits and budget under it; its tokens join the call's audit record.
    own = dataclasses.replace(
        call,
        request_id=call.request_id + "-compaction",
        reservation=None,
        rate_subjects=[],
        token_times=[],  # the answer's latencies stay its own
        output_text=[],
        inner_tokens=(0, 0, 0),
    )
    generation = Generation(ctx, own, wanted)
    try:
        texts = [step.text for step in [s async for s in generation.steps()]]
    finally:
        call.add_usage(own)  # counted once, whether or not it completed
    return Summary("".join(texts).strip(), generation.usage)


def framed(summary: str) -> str:
    """The summary as the prompt carries it, where the turns it replaces were."""
    return FRAME + summary
