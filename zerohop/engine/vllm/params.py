"""zerohop's `SamplingParams` as vLLM's: the same names and meanings (zerohop took vLLM's),
with the constraint as a Lark grammar for vLLM's guidance backend, the caller's scheduling
tags in `extra_args`, and deltas (not cumulative outputs) streamed back."""

from __future__ import annotations

from typing import Any

import vllm
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.sample.sampling_params import SamplingParams
from zerohop.engine.vllm.grammar import as_lark
from zerohop.engine.vllm.request_tags import RequestTags

# Fields that mean the same on both engines, copied as they are.
_SAME = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "max_tokens",
    "ignore_eos",
    "logprobs",
    "skip_special_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "bad_words",
    "allowed_token_ids",
    "n",
)


def vllm_params(
    params: SamplingParams, tags: RequestTags, thinking_supported: bool
) -> vllm.SamplingParams:
    """vLLM's SamplingParams for one request; InvalidRequestError for what the vLLM engine
    cannot honour (never dropped silently)."""
    fields: dict[str, Any] = {name: getattr(params, name) for name in _SAME}
    if params.thinking_budget is not None:
        if not thinking_supported:
            raise InvalidRequestError(
                "thinking budgets need a model with <think> and </think> tokens on the vLLM engine"
            )
        fields["thinking_token_budget"] = params.thinking_budget
    structured = None
    if params.grammar is not None:
        structured = StructuredOutputsParams(grammar=as_lark(params.grammar))
    try:
        return vllm.SamplingParams(
            **fields,
            stop=list(params.stop or []) or None,
            stop_token_ids=list(params.stop_token_ids) or None,
            logit_bias=dict(params.logit_bias) if params.logit_bias else None,
            structured_outputs=structured,
            extra_args=tags.to_extra_args(),
            output_kind=RequestOutputKind.DELTA,
        )
    except ValueError as exc:  # vLLM's own validation, in its words
        raise InvalidRequestError(str(exc)) from None
