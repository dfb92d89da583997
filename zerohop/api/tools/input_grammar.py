"""Whether a raw-input tool's input (tools/raw_input.py) is a sentence of its grammar: the
grammar run over the text's bytes, one token per byte, by the same backend that decodes it."""

from __future__ import annotations

import functools

import llguidance


class _Bytes:
    """A tokenizer of one token per byte, to run a grammar over a string."""

    def __init__(self) -> None:
        self.eos_token_id, self.bos_token_id = 256, None
        self.tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
        self.special_token_ids = [256]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def input_matches(grammar: str, text: str) -> bool:
    """Whether `text` is a whole sentence of `grammar` (a grammar built by
    engine/structured/grammar.py)."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if matcher.is_error():
        return False
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()
