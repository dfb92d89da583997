"""Whether a grammar admits a text, token by token with the tiny model's own tokenizer (the
way the engine's matcher walks it): for tests that check what a grammar means."""

from __future__ import annotations

from pathlib import Path

import llguidance
from tokenizers import Tokenizer


def decodes(folder: Path, grammar: str, text: str) -> bool:
    """Whether the model's tokens of `text` all pass `grammar` and may end there."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    index = llguidance.LLTokenizer(
        tokenizer.to_str(), n_vocab=tokenizer.get_vocab_size(), eos_token=[0]
    )
    matcher = llguidance.LLMatcher(index, grammar, log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()
