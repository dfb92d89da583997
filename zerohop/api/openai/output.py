"""What an OpenAI request produced, in the API's shapes, for whole and streamed responses alike:
usage, and logprobs with each token's text and bytes.
"""

from __future__ import annotations

from typing import Any

from zerohop.api.generation.events import Step, Usage
from zerohop.engine.text.byte_alphabet import byte_alphabet
from zerohop.engine.text.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # what OpenAI and vLLM report instead of -inf


def openai_usage(usage: Usage) -> dict[str, Any]:
    """The prompt once (it was prefilled once), the output of every choice."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.prompt_tokens + usage.output_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def legacy_columns() -> dict[str, list[Any]]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


class TokenTexts:
    """Each token id's text and raw bytes, for logprobs (cached: the vocabulary is bounded)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_level = type(tokenizer.backend.decoder).__name__ == "ByteLevel"
        self._unbyte = {c: b for b, c in byte_alphabet().items()}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            raw = self._raw(token_id)
            found = self._cache[token_id] = (raw.decode("utf-8", "replace"), list(raw))
        return found

    def _raw(self, token_id: int) -> bytes:
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in self._unbyte for c in piece):
            return bytes(self._unbyte[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])  # SentencePiece byte fallback
        if "▁" in piece:
            return piece.replace("▁", " ").encode()
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()


class LogprobFormatter:
    """A delta's logprobs in the chat API's shape and in the legacy completions API's."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokens = TokenTexts(tokenizer)

    def chat(self, step: Step, top: int) -> list[dict[str, Any]]:
        """OpenAI's `logprobs.content` entries for a step's tokens."""
        entries = []
        for token_id, candidates in zip(step.token_ids, step.logprobs or (), strict=False):
            token, raw = self.tokens.get(token_id)
            chosen = max(candidates.get(token_id, MIN_LOGPROB), MIN_LOGPROB)
            ranked = sorted(candidates.items(), key=lambda kv: -kv[1])[:top]
            entries.append(
                {
                    "token": token,
                    "logprob": chosen,
                    "bytes": raw,
                    "top_logprobs": [self._top_entry(i, lp) for i, lp in ranked],
                }
            )
        return entries

    def _top_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token, raw = self.tokens.get(token_id)
        return {"token": token, "logprob": max(logprob, MIN_LOGPROB), "bytes": raw}

    def legacy(self, step: Step, out: dict[str, list[Any]], offset: int) -> int:
        """Extend the completions API's column-wise logprobs by a step's tokens; the
        returned offset is where the next token's text starts."""
        for token_id, candidates in zip(step.token_ids, step.logprobs or (), strict=False):
            token, _ = self.tokens.get(token_id)
            out["tokens"].append(token)
            out["token_logprobs"].append(max(candidates.get(token_id, MIN_LOGPROB), MIN_LOGPROB))
            top: dict[str, float] = {}  # distinct ids can share a text ("\ufffd"): keep the best
            for i, lp in sorted(candidates.items(), key=lambda kv: -kv[1]):
                top.setdefault(self.tokens.get(i)[0], max(lp, MIN_LOGPROB))
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(token)
        return offset
