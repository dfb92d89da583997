"""The engine's constrained requests: each waits here while its grammar compiles, then
enters the scheduler with its own matcher, which the step masks by and advances with
every sampled token.

A matcher's state is a function of the output tokens alone, so it survives preemption by
recompute as it is (the tokens are kept); a continued answer (a client's failover) replays
the tokens it continues before its first step.
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.structured.compiler import GrammarCompiler
from zerohop.engine.structured.masking import GrammarMask

if TYPE_CHECKING:
    import llguidance
    import torch

    from zerohop.engine.sched.sequence import Sequence
    from zerohop.engine.text.tokenizer import Tokenizer

COMPILE_FAILED = "the constraint could not be compiled"
REFUSED_TOKEN = "the sampled token does not fit the request's constraint"


@dataclass(slots=True)
class _Compiling:
    seq: Sequence
    future: Future[llguidance.LLMatcher]
    continues: list[int]


@dataclass(slots=True)
class Admitted:
    ready: list[Sequence]  # matcher set: add them to the scheduler
    failed: list[tuple[Sequence, str]]  # with the reason to report


class Constraints:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.mask = GrammarMask(vocab_size)
        self._compiling: dict[str, _Compiling] = {}

    def add(self, seq: Sequence, continues: list[int] | None) -> None:
        assert seq.params.grammar is not None
        future = self.compiler.submit(seq.params.grammar)
        self._compiling[seq.request_id] = _Compiling(seq, future, list(continues or []))

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def discard(self, seq: Sequence) -> bool:
        """Forget `seq` if it is still compiling (aborted or failed); True if it was."""
        return self._compiling.pop(seq.request_id, None) is not None

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds for a compile to finish (when nothing else runs)."""
        futures = [c.future for c in self._compiling.values()]
        concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def admit(self) -> Admitted:
        """The requests whose grammar has compiled (or failed to) since the last call."""
        out = Admitted([], [])
        for request_id, entry in list(self._compiling.items()):
            if not entry.future.done():
                continue
            del self._compiling[request_id]
            try:
                entry.seq.matcher = entry.future.result().deep_copy()
            except InvalidRequestError as exc:
                out.failed.append((entry.seq, str(exc)))
                continue
            except Exception:
                out.failed.append((entry.seq, COMPILE_FAILED))
                continue
            if entry.continues and not entry.seq.matcher.consume_tokens(entry.continues):
                out.failed.append((entry.seq, "the continued tokens do not fit the constraint"))
                continue
            out.ready.append(entry.seq)
        return out

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        self.mask.apply(logits, [s.matcher for s in seqs])

    @staticmethod
    def advance(seq: Sequence, token: int) -> bool:
        """Feed the sampled token to `seq`'s matcher; True when the grammar is complete and
        allows nothing more, so the request ends. Raises when the token does not fit."""
        matcher = seq.matcher
        if matcher is None:
            return False
        if not matcher.consume_token(token) or matcher.is_error():
            raise ConstraintViolation(REFUSED_TOKEN)
        return matcher.is_stopped()

    def close(self) -> None:
        self.compiler.close()


class ConstraintViolation(RuntimeError):
    """A sampled token the matcher refused (a masking bug, or a token forced by EOS rules)."""
