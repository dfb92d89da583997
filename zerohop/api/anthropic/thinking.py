"""Extended thinking on the Anthropic Messages surface (reasoning.py has the format).

- `thinking` on a model without a reasoning format is a 400. On a model with one, `enabled`
  (or `adaptive`) renders the template with `enable_thinking=True` and the response begins
  with a `thinking` block (signed; streamed as thinking_delta events, then a
  signature_delta, then its stop), then the text (and tool_use) blocks from index 1.
  `disabled`, or no `thinking`, renders `enable_thinking=False`, and the output is all text.
- `budget_tokens` must be >= 1024 and < max_tokens, as in the API. The engine closes the
  thought by force once it has that many tokens (zerohop.engine.sample.thought_budget), and the
  model answers after it; `adaptive` has no budget: the thought runs until the model closes
  it or max_tokens is reached.
- Thinking is refused with a forced tool call (as in the API), with `output_config.format`
  (its grammar would constrain the thought), with a prefill and with the failover extensions.
- A `thinking` block in an assistant turn must carry the signature this server gave it (a
  forged or edited thought is a 400); past thoughts are then left out of the prompt, as
  Qwen3-style templates leave out the thoughts of earlier turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from zerohop.api.anthropic.schema import (
    CountTokensRequest,
    MessagesRequest,
    ThinkingBlock,
    ThinkingDisabled,
    ThinkingEnabled,
)
from zerohop.api.anthropic.tools import ToolEvents, ToolOutput, sse_event
from zerohop.api.conversation.reasoning import ReasoningParser, has_reasoning_format, sign, verify
from zerohop.api.errors import ApiError
from zerohop.engine.sample.sampling_params import SamplingParams

MIN_BUDGET = 1024


def thinking_mode(
    request: CountTokensRequest, chat_template: str | None, model: str
) -> bool | None:
    """True: think; False: the model can, but not now; None: the model has no reasoning format."""
    check_signatures(request)
    reasoning = has_reasoning_format(chat_template)
    if request.thinking is None:
        return False if reasoning else None
    if not reasoning:
        raise ApiError(
            400,
            f"thinking: not supported by the model {model}: it has no reasoning format"
            " (its chat template has no <think>)",
            param="thinking",
        )
    return not isinstance(request.thinking, ThinkingDisabled)


def check_thinking(request: MessagesRequest, grammar: str | None) -> None:
    """The rules of a request that thinks (see the module docstring)."""
    config = request.thinking
    if isinstance(config, ThinkingEnabled):
        if config.budget_tokens < MIN_BUDGET:
            raise ApiError(400, f"thinking.budget_tokens: must be >= {MIN_BUDGET}")
        if config.budget_tokens >= request.max_tokens:
            raise ApiError(400, "max_tokens: must be greater than thinking.budget_tokens")
    if grammar is not None:
        raise ApiError(
            400,
            "thinking: may not be enabled with a forced tool call or output_config.format",
            param="thinking",
        )
    last = request.messages[-1] if request.messages else None
    if last is not None and last.role == "assistant":
        raise ApiError(400, "thinking: may not be enabled with a prefilled assistant message")
    if request.return_token_ids or request.continue_token_ids:
        raise ApiError(400, "thinking: not supported with return_token_ids or continue_token_ids")


def with_budget(params: SamplingParams, request: MessagesRequest, opened: bool) -> SamplingParams:
    """`params` with the request's thinking budget; `opened`: the prompt opened the thought."""
    config = request.thinking
    if not isinstance(config, ThinkingEnabled):
        return params
    return replace(params, thinking_budget=config.budget_tokens, thought_open=opened)


def check_signatures(request: CountTokensRequest) -> None:
    for i, message in enumerate(request.messages):
        if isinstance(message.content, str):
            continue
        for j, block in enumerate(message.content):
            if not isinstance(block, ThinkingBlock):
                continue
            at = f"messages.{i}.content.{j}"
            if message.role != "assistant":
                raise ApiError(400, f"{at}: thinking blocks are for assistant turns")
            if not verify(block.thinking, block.signature):
                raise ApiError(400, f"{at}.signature: invalid signature for this thinking block")


def thinking_block(thought: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": thought, "signature": sign(thought)}


@dataclass
class ThinkingOutput:
    """A thinking response's content, fed piece by piece: the thought, then the answer
    (through `tools` when the request has tools)."""

    parser: ReasoningParser
    tools: ToolOutput | None = None
    thought: str = ""
    text: str = ""

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        thought, answer = self.parser.feed(piece, final)
        self.thought += thought
        self.text += answer
        return thought, answer

    def content(self) -> list[dict[str, Any]]:
        if self.tools is not None:
            self.tools.feed(self.text, final=True)
            return [thinking_block(self.thought), *self.tools.content()]
        return [thinking_block(self.thought), {"type": "text", "text": self.text}]


START = sse_event(
    "content_block_start",
    {"index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
)


@dataclass
class ThinkingEvents:
    """The SSE events after `START`: thinking deltas, the signature and the block's stop,
    then the answer's blocks from index 1."""

    output: ThinkingOutput
    closed: bool = False
    text_open: bool = False
    blocks: ToolEvents = field(default_factory=lambda: ToolEvents(index=0, first=1))

    def events(self, piece: str, final: bool) -> bytes:
        thought, answer = self.output.feed(piece, final)
        out = b""
        if thought:
            delta = {"type": "thinking_delta", "thinking": thought}
            out += sse_event("content_block_delta", {"index": 0, "delta": delta})
        if not self.closed and (self.output.parser.thought_done or final):
            out += self._close()
        if answer or final:
            out += self._answer(answer, final)
        return out

    def end(self) -> bytes:
        if self.output.tools is not None:
            return self.blocks.end()
        out = b"" if self.text_open else _text_start()
        return out + sse_event("content_block_stop", {"index": 1})

    def _close(self) -> bytes:
        self.closed = True
        delta = {"type": "signature_delta", "signature": sign(self.output.thought)}
        out = sse_event("content_block_delta", {"index": 0, "delta": delta})
        return out + sse_event("content_block_stop", {"index": 0})

    def _answer(self, answer: str, final: bool) -> bytes:
        if self.output.tools is not None:
            return self.blocks.events(*self.output.tools.feed(answer, final=final))
        if not answer:
            return b""
        out = b"" if self.text_open else _text_start()
        self.text_open = True
        delta = {"type": "text_delta", "text": answer}
        return out + sse_event("content_block_delta", {"index": 1, "delta": delta})


def _text_start() -> bytes:
    block = {"type": "text", "text": ""}
    return sse_event("content_block_start", {"index": 1, "content_block": block})
