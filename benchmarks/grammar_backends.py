"""xgrammar against llguidance on the default model's vocabulary (49,152 tokens): the
cost a grammar backend adds to serving, measured the way the engine would use it.

For each backend: the time to build the tokenizer's index (once per model), to compile a
typical JSON schema (cold, once per schema), and the time per decode step to fill the
token bitmask of a batch of 1 and of 32 requests that walk through a valid document, plus
the time to advance the matchers by the sampled tokens.

    .venv/bin/python benchmarks/grammar_backends.py --out grammar_backends.json

Needs both backends in the venv (`pip install llguidance xgrammar`); the project keeps only
the one this chose.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from zerohop.engine.loading.checkpoint import open_checkpoint
from zerohop.engine.text.byte_alphabet import byte_alphabet
from zerohop.models.default import default_model_path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    },
    "required": ["name", "age", "role", "tags", "address", "score"],
    "additionalProperties": False,
}
WHITESPACE = r"[ \n]{0,2}"  # what the engine allows between JSON tokens, both backends
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "admin",
    "tags": ["math", "engines", "poetry"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
    "score": 99.5,
}


def vocabulary_bytes(tokenizer) -> list[bytes]:
    """Each token id's bytes (byte-level BPE spelling undone; special tokens as text)."""
    decode = {ch: b for b, ch in byte_alphabet().items()}
    backend = tokenizer.backend
    out = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        token = backend.id_to_token(i) or ""
        if all(ch in decode for ch in token):
            out.append(bytes(decode[ch] for ch in token))
        else:
            out.append(token.encode())
    return out


def timed(fn, repeat: int = 1) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - started)
    return best, result


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, eos: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        vocab = vocabulary_bytes(tokenizer)
        self.vocab_size = len(vocab)
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=True, max_whitespace_cnt=2, strict_mode=True
        )

    def matchers(self, compiled, n: int) -> list:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, self.vocab_size)

    def fill(self, matchers: list, mask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)

    def advance(self, matchers: list, token: int) -> None:
        for m in matchers:
            assert m.accept_token(token), "the document's token was refused"


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, eos: list[int]) -> None:
        import llguidance
        import llguidance.torch

        self.llg = llguidance
        self.vocab_size = tokenizer.backend.get_vocab_size(with_added_tokens=True)
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos[0]
        )
        self.executor = llguidance.LLExecutor(num_threads=1)

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_pattern": WHITESPACE}
        )
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matchers(self, grammar, n: int) -> list:
        return [self.llg.LLMatcher(self.tokenizer, grammar) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.llg.torch.allocate_token_bitmask(n, self.vocab_size)

    def fill(self, matchers: list, mask: torch.Tensor) -> None:
        if len(matchers) == 1:
            self.llg.torch.fill_next_token_bitmask(matchers[0], mask, 0)
        else:
            pairs = [(m, i) for i, m in enumerate(matchers)]
            self.llg.torch.fill_next_token_bitmask_par(self.executor, pairs, mask)

    def advance(self, matchers: list, token: int) -> None:
        for m in matchers:
            assert m.consume_token(token), m.get_error()


def measure(backend, tokens: list[int], batches: list[int]) -> dict:
    compile_s = []
    for i in range(5):  # a fresh schema each time: a title the cache has not seen
        schema = {**SCHEMA, "title": f"Person{i}"}
        seconds, compiled = timed(lambda s=schema: backend.compile(s))
        compile_s.append(seconds)
    out: dict = {"compile_ms": statistics.median(compile_s) * 1e3}
    for n in batches:
        matchers = backend.matchers(compiled, n)
        mask = backend.bitmask(n)
        fill_s, advance_s = [], []
        for token in tokens:
            seconds, _ = timed(lambda ms=matchers, mk=mask: backend.fill(ms, mk))
            fill_s.append(seconds)
            allowed = (mask[0, token // 32] >> (token % 32)) & 1
            assert int(allowed) == 1, f"the mask refused the document's token {token}"
            seconds, _ = timed(lambda ms=matchers, t=token: backend.advance(ms, t))
            advance_s.append(seconds)
        out[f"batch_{n}"] = {
            "mask_ms_median": statistics.median(fill_s) * 1e3,
            "mask_ms_p90": sorted(fill_s)[int(0.9 * len(fill_s))] * 1e3,
            "advance_ms_median": statistics.median(advance_s) * 1e3,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("grammar_backends.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = open_checkpoint(default_model_path()).tokenizer()
    eos = sorted(tokenizer.eos_token_ids)
    tokens = tokenizer.encode(json.dumps(DOCUMENT, separators=(",", ":")), False)
    results = {"vocab_size": tokenizer.vocab_size, "document_tokens": len(tokens)}
    for cls in (XGrammar, LLGuidance):
        seconds, backend = timed(lambda c=cls: c(tokenizer, eos))
        figures = {"tokenizer_index_ms": seconds * 1e3, **measure(backend, tokens, [1, 32])}
        results[cls.name] = figures
        print(cls.name, json.dumps(figures, indent=1))
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
