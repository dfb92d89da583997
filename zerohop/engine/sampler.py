"""Choosing the next token of each request from its logits.

Greedy rows take the argmax in one batched op. Sampled rows apply temperature, top-k and
top-p, then draw with the request's own generator, one row at a time: a seeded request
draws the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerohop.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    # Per row: (chosen token's logprob, top-N {token: logprob}) when the request asked.
    logprobs: list[tuple[float, dict[int, float]] | None]
    # Per row: why the row could not be sampled (NaN logits, ...), else None.
    errors: list[str | None]


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> SampleResult:
        assert logits.shape[0] == len(params) == len(generators)
        # A NaN or +inf anywhere in a row makes its max non-finite, and so does a row that
        # is all -inf: one pass, far cheaper than isfinite().all(); -inf alone is a token
        # a grammar or a bias ruled out.
        finite = logits.amax(dim=-1).isfinite().tolist()
        token_ids = logits.argmax(dim=-1).tolist()
        errors: list[str | None] = [
            None if ok else "the model produced non-finite logits" for ok in finite
        ]
        for row, p in enumerate(params):
            if not p.greedy and errors[row] is None:
                token_ids[row] = self._sample_row(logits[row], p, generators[row])
        return SampleResult(token_ids, self._logprobs(logits, params, token_ids), errors)

    @staticmethod
    def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
        scaled = row / p.temperature
        if p.top_k > 0 and p.top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            probs = _top_p(probs, p.top_p)
        return int(torch.multinomial(probs, 1, generator=gen).item())

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


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs[mass_before >= top_p] = 0.0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
