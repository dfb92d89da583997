"""The paged KV block pool with prefix caching.

Each full block is named by a hash chained with its parent block's hash and the request's
cache salt, so a block is shared only by requests with the same salt and the same tokens
from the very start. Freed blocks keep their contents and hash, and are reused least
recently used first; a request whose prompt starts with cached blocks skips computing them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from zerohop.engine.sched.sequence import Sequence


@dataclass(slots=True)
class CacheCounters:
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0


def block_hash(parent: bytes | None, tokens: list[int], salt: str | None) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0")
    h.update((salt or "").encode())
    h.update(b"\0")
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.counters = CacheCounters()

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    # -- prefix matching -------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold the start of `seq`; at least one token is left to compute."""
        self._extend_hashes(seq, (seq.num_tokens - 1) // self.block_size)
        if not self.enable_caching:
            return []
        hits = []
        for digest in seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]:
            block = self.cached.get(digest)
            if block is None:
                break
            hits.append(block)
        return hits

    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_full_blocks):
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(
                block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.cache_salt)
            )

    # -- allocation --------------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that `num_tokens` tokens fit in its table."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        total = len(hits) * self.block_size + num_new_tokens
        new = -(-total // self.block_size) - len(hits)
        return revived + new <= self.num_free

    def admit(self, seq: Sequence, hits: list[int], num_prompt_tokens: int) -> None:
        assert not seq.block_table
        self.counters.prefix_query_tokens += num_prompt_tokens
        self.counters.prefix_hit_tokens += len(hits) * self.block_size
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
        seq.block_table.extend(hits)
        seq.num_committed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s table to hold `num_tokens` tokens; False if the pool is short."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self.free):
            return False
        for _ in range(needed):
            block, _ = self.free.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def share(self, src: Sequence, dst: Sequence, num_blocks: int) -> None:
        """Give `dst` the first `num_blocks` blocks of `src`'s table, one more reference
        each: a forked choice reads its parent's computed prompt instead of recomputing it.
        Releasing either sequence drops only its own references."""
        assert not dst.block_table and num_blocks <= len(src.block_table)
        blocks = src.block_table[:num_blocks]
        for block in blocks:
            assert self.ref_counts[block] > 0, "only blocks in use are shared"
            self.ref_counts[block] += 1
        dst.block_table.extend(blocks)
        dst.num_committed_blocks = min(src.num_committed_blocks, num_blocks)

    def _evict(self, block: int) -> None:
        digest = self.hash_of[block]
        if digest is not None:
            self.hash_of[block] = None
            if self.cached.get(digest) == block:
                del self.cached[digest]

    def release(self, seq: Sequence) -> None:
        # Tail blocks first, so a prompt's later blocks are evicted before its shared start.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0
            if self.ref_counts[block] == 0:
                self.free[block] = None
                if self.hash_of[block] is None:
                    self.free.move_to_end(block, last=False)  # holds nothing reusable
        seq.block_table.clear()
        seq.num_committed_blocks = 0

    def commit(self, seq: Sequence) -> None:
        """Name the blocks `seq` has completely computed, so later requests can reuse them."""
        if not self.enable_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        self._extend_hashes(seq, num_full)
        for i in range(seq.num_committed_blocks, num_full):
            block = seq.block_table[i]
            digest = seq.block_hashes[i]
            if self.hash_of[block] is None and digest not in self.cached:
                self.hash_of[block] = digest
                self.cached[digest] = block
        seq.num_committed_blocks = max(seq.num_committed_blocks, num_full)
