"""Grammars compiled off the step loop: one worker thread, a cache keyed by the grammar.

llguidance builds a matcher in well under a millisecond for a typical schema, but a large
grammar can take longer, and the tokenizer's index takes ~0.3 s once per engine (at its
first grammar, so an engine that never sees one never pays); both run on the worker
(llguidance drops the GIL while it builds), so a request waits in the queue while its
grammar compiles, never the batch. Each request gets a copy of the cached
matcher (a deep copy costs about a microsecond).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance

from zerohop.engine.base.errors import InvalidRequestError

if TYPE_CHECKING:
    from zerohop.engine.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)
CACHE_SIZE = 256  # grammars kept compiled (a matcher is a few KB to a few MB)


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerohop-grammar")
        self._cache: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, sorted(eos_token_ids)
        self._index: Future[llguidance.LLTokenizer] | None = None  # built on first use

    def submit(self, grammar: str) -> Future[llguidance.LLMatcher]:
        """The compiled matcher for `grammar` (shared: take `.deep_copy()` per request);
        the future raises InvalidRequestError when the grammar does not compile."""
        future = self._cache.get(grammar)
        if future is not None:
            self._cache.move_to_end(grammar)
            return future
        if self._index is None:  # an engine that never sees a grammar never pays for it
            tokenizer_json = self._tokenizer.backend.to_str()
            self._index = self._worker.submit(
                _token_index, tokenizer_json, self._vocab_size, self._eos
            )
        future = self._worker.submit(self._compile, grammar, self._index)
        self._cache[grammar] = future
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    @staticmethod
    def _compile(grammar: str, index: Future[llguidance.LLTokenizer]) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(index.result(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"the constraint cannot be compiled: {matcher.get_error()}")
        return matcher

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


def _token_index(tokenizer_json: str, vocab_size: int, eos: list[int]) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
