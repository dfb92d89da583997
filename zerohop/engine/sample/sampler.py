"""Choosing the next token of each request from its logits.

The rows whose request set penalties, biases or bans are processed first (a copy of just
those rows, zerohop.engine.sample.logits_processors), as vLLM does. Greedy rows then take the
argmax in one batched op. Sampled rows apply temperature, min_p, top-k and top-p, then draw
with the request's own generator, one row at a time: a seeded request draws the same tokens
whatever else shares its batch. Logprobs are those of the logits as received (vLLM's raw).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from zerohop.engine.sample.logits_processors import (
    NEG_INF,
    Encoder,
    History,
    LogitsProcessors,
    apply_min_p,
)
from zerohop.engine.sample.sampling_params import SamplingParams

NON_FINITE = "the model produced non-finite logits"
NO_TOKEN_LEFT = "the request's constraints and options leave no token it may generate"


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    # Per row: (chosen token's logprob, top-N {token: logprob}) when the request asked.
    logprobs: list[tuple[float, dict[int, float]] | None]
    # Per row: why the row could not be sampled (NaN logits, ...), else None.
    errors: list[str | None]


class SequenceWithGenerator(History, Protocol):
    """A request as the sampler reads it (zerohop.engine.sched.sequence.Sequence)."""

    generator: torch.Generator | None


class Sampler:
    def __init__(self, eos_token_ids: Iterable[int] = (), tokenizer: Encoder | None = None) -> None:
        """`eos_token_ids` are banned before min_tokens; `tokenizer` tokenizes bad_words."""
        self.processors = LogitsProcessors(eos_token_ids, tokenizer)

    def __call__(self, logits: torch.Tensor, seqs: Sequence[SequenceWithGenerator]) -> SampleResult:
        assert logits.shape[0] == len(seqs)
        params = [seq.params for seq in seqs]
        errors = _row_errors(logits)
        rows, processed = self.processors(logits, seqs)
        some_raw = len(rows) < len(seqs)
        token_ids = logits.argmax(dim=-1).tolist() if some_raw else [0] * len(seqs)
        source = {} if processed is None else _take_processed(rows, processed, token_ids, errors)
        for i, p in enumerate(params):
            if not p.greedy and errors[i] is None:
                row = source[i] if i in source else logits[i]
                token_ids[i] = self._sample_row(row, p, seqs[i].generator)
        return SampleResult(token_ids, self._logprobs(logits, params, token_ids), errors)

    @staticmethod
    def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
        return int(torch.multinomial(probabilities(row, p), 1, generator=gen).item())

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, params: list[SamplingParams], token_ids: list[int]
    ) -> list[tuple[float, dict[int, float]] | None]:
        out: list[tuple[float, dict[int, float]] | None] = [None] * len(params)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return out
        logp = torch.log_softmax(logits[rows], dim=-1)
        n = max(params[i].logprobs or 0 for i in rows)
        top_values, top_ids = logp.topk(max(n, 1), dim=-1)
        for j, i in enumerate(rows):
            k = params[i].logprobs or 0
            top = dict(zip(top_ids[j, :k].tolist(), top_values[j, :k].tolist(), strict=True))
            out[i] = (float(logp[j, token_ids[i]]), top)
        return out


def probabilities(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled row draws from: temperature, min_p, top-k, then top-p."""
    scaled = row / p.temperature
    if p.min_p > 0:
        scaled = apply_min_p(scaled, p.min_p)
    if p.top_k > 0 and p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return _top_p(probs, p.top_p) if p.top_p < 1.0 else probs


def _take_processed(
    rows: list[int], processed: torch.Tensor, token_ids: list[int], errors: list[str | None]
) -> dict[int, torch.Tensor]:
    """Greedy tokens of the processed rows into `token_ids` (NO_TOKEN_LEFT where the options
    left nothing but -inf); returns each processed row by its row in the batch."""
    best = processed.max(dim=-1)
    for i, token, top in zip(rows, best.indices.tolist(), best.values.tolist(), strict=True):
        token_ids[i] = token
        if top == NEG_INF and errors[i] is None:
            errors[i] = NO_TOKEN_LEFT
    return dict(zip(rows, processed, strict=True))


def _row_errors(logits: torch.Tensor) -> list[str | None]:
    """Per row, NON_FINITE for a NaN or +inf, NO_TOKEN_LEFT when all of it is -inf."""
    # A NaN or +inf anywhere in a row makes its max non-finite, and so does a row that is
    # all -inf: one pass, far cheaper than isfinite().all(); -inf alone is a token a
    # grammar or a bias ruled out.
    top = logits.amax(dim=-1)
    finite = top.isfinite().tolist()
    if all(finite):
        return [None] * len(finite)
    empty = (top == NEG_INF).tolist()
    return [
        None if ok else NO_TOKEN_LEFT if none_left else NON_FINITE
        for ok, none_left in zip(finite, empty, strict=True)
    ]


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs[mass_before >= top_p] = 0.0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
