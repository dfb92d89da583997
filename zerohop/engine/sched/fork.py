"""`n` choices from one prompt: the prompt is prefilled once, as the parent sequence (choice
0), and in the step its prompt completes (its first sampling) n-1 children fork from it.

A child starts with the parent's tokens and computed cache: it shares the parent's full KV
blocks (one more reference each) and gets its own copy of the partial last block (copied on
fork, so neither writes into the other's), then samples its first token from the parent's
logits row, with its own generator (seed + index when the request is seeded) and its own
detokenizer and grammar state. It goes straight into the scheduler's running list, and is
from then on a sequence like any other (preempted by recompute, its release dropping only its
own references). A child that finds no free sequence slot or block for its copy waits in the
queue instead and prefills on its own (the prefix cache serves the shared full blocks).

Children live in the engine's requests under internal ids (`child_id`); `relabel` gives
their deltas the parent's request id and their choice's index, and aborting the request
aborts every child. Only the parent's prompt is charged: forked children are never admitted
from the queue, and their output tokens are charged each step like any sequence's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Protocol

import torch

from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.base.outputs import RequestDelta
from zerohop.engine.sched.block_pool import BlockPool
from zerohop.engine.sched.scheduler import POLICY_FAILED, ScheduledChunk, Scheduler
from zerohop.engine.sched.sequence import Sequence, Status

log = logging.getLogger(__name__)

SEPARATOR = "\x1f"  # between the request id and the choice index of a child's internal id
SEED_MASK = 2**64 - 1  # torch seeds are 64-bit


class BlockCopier(Protocol):
    """What forking needs of the model runner (engine/runner.py): its device, and copying
    cache blocks (a child's own copy of the parent's partial last block)."""

    device: torch.device

    def copy_blocks(self, src: list[int], dst: list[int]) -> None: ...


def child_id(request_id: str, index: int) -> str:
    return f"{request_id}{SEPARATOR}{index}"


def check_n(n: int, max_num_seqs: int) -> None:
    """Every choice of a request must be able to run at once."""
    if n > max_num_seqs:
        raise InvalidRequestError(
            f"n is {n}, but this server runs at most {max_num_seqs} sequences at once"
            " (max_num_seqs)"
        )


class Forks:
    """The children of `n` > 1 requests: forking them, naming their deltas, aborting them."""

    def __init__(
        self,
        pool: BlockPool,
        runner: BlockCopier,
        scheduler: Scheduler,
        requests: dict[str, Sequence],
    ) -> None:
        self.pool, self.runner, self.scheduler, self.requests = pool, runner, scheduler, requests
        self.child_of: dict[str, tuple[str, int]] = {}  # internal id -> (request id, index)
        self.families: dict[str, list[str]] = {}  # request id -> its unfinished children

    # -- forking ---------------------------------------------------------------------------

    def fork(
        self,
        logits: torch.Tensor,
        chunks: list[ScheduledChunk],
        completing: list[Sequence],
        deltas: dict[str, RequestDelta],
    ) -> torch.Tensor:
        """Fork the children of every parent whose prompt completes this step (after the
        forward pass and `_advance`, before sampling). Extends, in place, `completing` by the
        children that sample now (the returned logits gain their parent's row for each),
        `chunks` by an empty chunk each (so their tokens are charged) and `deltas` by a delta
        for every child."""
        rows: list[int] = []
        for row, parent in enumerate(list(completing)):
            if self._forks(parent):
                for child in self._fork_family(parent, deltas):
                    completing.append(child)
                    chunks.append(ScheduledChunk(child, 0))
                    rows.append(row)
        if not rows:
            return logits
        return torch.cat([logits, logits[rows]])

    def _forks(self, seq: Sequence) -> bool:
        return (
            seq.params.n > 1
            and seq.num_output_tokens == 0
            and not seq.is_finished
            and seq.request_id not in self.child_of
        )

    def _fork_family(self, parent: Sequence, deltas: dict[str, RequestDelta]) -> list[Sequence]:
        """Create the parent's children; return those that sample this step (the others
        wait in the queue, or failed there)."""
        children = [_child(parent, i, self.runner.device) for i in range(1, parent.params.n)]
        placed = self._place(parent, children)
        family = self.families.setdefault(parent.request_id, [])
        for i, child in enumerate(children, start=1):
            self.child_of[child.request_id] = (parent.request_id, i)
            family.append(child.request_id)
            self.requests[child.request_id] = child
            deltas[child.request_id] = _first_delta(child)
            if child in placed:
                child.status = Status.RUNNING
                self.scheduler.running.append(child)
            else:
                self._queue(child, deltas[child.request_id])
        return placed

    def _place(self, parent: Sequence, children: list[Sequence]) -> list[Sequence]:
        """Give children the parent's computed cache while slots and blocks last."""
        bs = self.pool.block_size
        num_full, partial = divmod(parent.num_computed_tokens, bs)
        slots = self.scheduler.max_num_seqs - len(self.scheduler.running)
        placed: list[Sequence] = []
        for child in children[: max(slots, 0)]:
            if partial and self.pool.num_free < 1:
                break
            self.pool.share(parent, child, num_full)
            allocated = self.pool.allocate(child, parent.num_computed_tokens)
            assert allocated, "a free block was counted"
            child.num_computed_tokens = parent.num_computed_tokens
            placed.append(child)
        if partial and placed:
            try:
                src = parent.block_table[num_full]
                self.runner.copy_blocks([src] * len(placed), [c.block_table[-1] for c in placed])
            except Exception:  # they prefill on their own instead
                log.exception("copying request %s's last KV block failed", parent.request_id)
                for child in placed:
                    self.pool.release(child)
                    child.num_computed_tokens = 0
                return []
        return placed

    def _queue(self, child: Sequence, delta: RequestDelta) -> None:
        try:
            self.scheduler.add(child)
        except Exception:  # the policy failed on it: this choice fails
            log.exception("scheduling policy failed to add request %s", child.request_id)
            self.requests.pop(child.request_id, None)
            child.finish("error")
            child.error = POLICY_FAILED
            delta.finished, delta.finish_reason, delta.error = True, "error", POLICY_FAILED

    # -- naming and aborting ---------------------------------------------------------------

    def relabel(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        """Children's deltas under their request's id, with their choice's index."""
        for delta in deltas:
            found = self.child_of.get(delta.request_id)
            if found is None:
                continue
            internal = delta.request_id
            delta.request_id, delta.index = found
            if delta.finished:
                self._forget(internal, found[0])
        return deltas

    def _forget(self, internal: str, request_id: str) -> None:
        del self.child_of[internal]
        family = self.families[request_id]
        family.remove(internal)
        if not family:
            del self.families[request_id]

    def with_children(self, request_ids: Iterable[str]) -> list[str]:
        """The ids to abort for these: each request's own and its unfinished children's."""
        out: list[str] = []
        for request_id in request_ids:
            out.append(request_id)
            out.extend(self.families.get(request_id, ()))
        return out


def _child(parent: Sequence, index: int, device: torch.device) -> Sequence:
    """Choice `index` of `parent`'s request, in the parent's state before its first sample.
    Per-request state the engine gives a sequence at add time is forked here too."""
    child = Sequence(
        request_id=child_id(parent.request_id, index),
        prompt_token_ids=parent.prompt_token_ids,
        params=parent.params,
        max_tokens=parent.max_tokens,
        tenant=parent.tenant,
        weight=parent.weight,
        priority=parent.priority,
        cache_salt=parent.cache_salt,
        arrival=parent.arrival,
        token_ids=list(parent.token_ids),
        block_hashes=list(parent.block_hashes),
        num_cached_tokens=max(parent.num_cached_tokens, 0),
    )
    seed = parent.params.seed
    if seed is not None:
        generator = torch.Generator(device=device)
        child.generator = generator.manual_seed((seed + index) & SEED_MASK)
    if parent.detokenizer is not None:
        child.detokenizer = parent.detokenizer.fork()
    if parent.matcher is not None:
        child.matcher = parent.matcher.deep_copy()
    if parent.thought is not None:
        child.thought = dataclasses.replace(parent.thought)
    return child


def _first_delta(child: Sequence) -> RequestDelta:
    return RequestDelta(
        child.request_id,
        num_prompt_tokens=child.num_prompt_tokens,
        cached_tokens=child.num_cached_tokens,
    )
