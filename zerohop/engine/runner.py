"""Turns a scheduled step into one forward pass: flat batch, cache slots, attention groups."""

from __future__ import annotations

import torch

from zerohop.engine.model.attention import AttentionBatch, DecodeGroup, PrefillChunk
from zerohop.engine.model.decode_step import build_decode_step
from zerohop.engine.model.decoder import CausalLM
from zerohop.engine.sched.scheduler import ScheduledChunk


class ModelRunner:
    def __init__(
        self, model: CausalLM, num_blocks: int, block_size: int, enforce_eager: bool = False
    ) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = model.device
        shape = (num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=model.dtype, device=model.device),
                torch.zeros(shape, dtype=model.dtype, device=model.device),
            )
            for _ in range(cfg.num_layers)
        ]
        self.decode_step = None if enforce_eager else build_decode_step(model, self.kv_caches)

    @staticmethod
    def kv_bytes_per_block(model: CausalLM, block_size: int) -> int:
        cfg = model.config
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
        itemsize: int = model.dtype.itemsize  # torch is skipped by mypy: its values are Any
        return per_token * block_size * itemsize

    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Run the step; return logits [len(completing chunks), vocab] in `chunks` order.

        `chunks` must list decodes first (see `order_chunks`). A chunk with proposed tokens
        gives a row of logits per token, each predicting the token after it.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        for chunk in chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            span = range(start, start + chunk.num_tokens)
            input_ids.extend(seq.token_ids[start : start + chunk.num_tokens])
            positions.extend(span)
            table, bs = seq.block_table, self.block_size
            slots.extend(table[p // bs] * bs + p % bs for p in span)
            if chunk.completes:
                end = len(input_ids)
                logits_rows.extend(range(end - 1 - chunk.num_draft, end))
        attn = AttentionBatch(
            slot_mapping=self._tensor(slots),
            decode=self._decode_group(chunks),
            prefills=self._prefill_chunks(chunks),
        )
        ids, pos, rows = self._tensor(input_ids), self._tensor(positions), self._tensor(logits_rows)
        if self.decode_step is not None and self.decode_step.supports(len(input_ids), attn):
            return self.decode_step(ids, pos, attn, rows)
        return self.model.forward(ids, pos, attn, self.kv_caches, rows)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole cache blocks, every layer's K and V: block src[i] into dst[i]."""
        assert len(src) == len(dst)
        if not src:
            return
        offsets = torch.arange(self.block_size, device=self.device)
        bs = self.block_size
        from_slots = (self._tensor(src).unsqueeze(1) * bs + offsets).flatten()
        to_slots = (self._tensor(dst).unsqueeze(1) * bs + offsets).flatten()
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(0, to_slots, k_cache.index_select(0, from_slots))
            v_cache.index_copy_(0, to_slots, v_cache.index_select(0, from_slots))

    @staticmethod
    def order_chunks(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        return sorted(chunks, key=lambda c: not c.is_decode)

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _decode_group(self, chunks: list[ScheduledChunk]) -> DecodeGroup | None:
        """One row per decoded token: a proposed token's row sees the keys before it, its
        request's cached ones and the rows before it in this step (written first)."""
        rows = [
            (c.seq.block_table, c.seq.num_computed_tokens + i + 1)
            for c in chunks
            if c.is_decode
            for i in range(c.num_tokens)
        ]
        if not rows:
            return None
        lengths = [length for _, length in rows]
        context_lens, max_len = self._tensor(lengths), max(lengths)
        key_slots = self._key_slots([table for table, _ in rows], max_len)
        key_mask = None  # the decode kernel reads context_lens; SDPA needs the mask
        if self.model.cache_kernels is None:
            key_pos = torch.arange(max_len, device=self.device)
            key_mask = (key_pos.unsqueeze(0) < context_lens.unsqueeze(1)).view(len(rows), 1, 1, -1)
        return DecodeGroup(len(rows), key_slots, key_mask, context_lens)

    def _prefill_chunks(self, chunks: list[ScheduledChunk]) -> list[PrefillChunk]:
        out, row = [], 0
        for chunk in chunks:
            n, start = chunk.num_tokens, chunk.seq.num_computed_tokens
            if not chunk.is_decode:
                out.append(self._prefill_chunk(chunk, row, n, start))
            row += n
        return out

    def _prefill_chunk(self, chunk: ScheduledChunk, row: int, n: int, start: int) -> PrefillChunk:
        kernels = self.model.cache_kernels is not None
        if start == 0 and not kernels:
            return PrefillChunk(row, n, None, None)
        ctx = start + n
        key_slots = self._key_slots([chunk.seq.block_table], ctx)[0]
        if kernels:  # the prompt kernel reads context lengths, not a mask
            return PrefillChunk(row, n, key_slots, None)
        query_pos = torch.arange(start, ctx, device=self.device).unsqueeze(1)
        mask = torch.arange(ctx, device=self.device).unsqueeze(0) <= query_pos
        return PrefillChunk(row, n, key_slots, mask)

    def _key_slots(self, tables: list[list[int]], length: int) -> torch.Tensor:
        """[len(tables), length] cache slots of positions 0..length-1 (padding -> slot 0)."""
        num_blocks = -(-length // self.block_size)
        padded = [t[:num_blocks] + [0] * (num_blocks - len(t[:num_blocks])) for t in tables]
        blocks = self._tensor(padded)
        pos = torch.arange(length, device=self.device)
        return blocks[:, pos // self.block_size] * self.block_size + pos % self.block_size
