"""Attention over the paged KV cache for one flat batch of decode tokens and prefill chunks.

The cache of one layer is a tensor [num_slots, kv_heads, head_dim]; slot = block * block_size
+ offset. A step's flat batch puts all decode tokens first (one per sequence), then each
prefill chunk. With zerohop's CPU kernels every row, decode or prompt, is attended by one
per-row routine over its keys in the cache (so a position's result does not depend on how its
prompt was chunked, cached or batched); without them, one batched SDPA call for the decode
tokens and one per chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True, frozen=True)
class CacheKernels:
    """zerohop's C++ cache operations (CPU): `write_kv(k, v, k_cache, v_cache, slots)`,
    `decode_attention(q, k_cache, v_cache, key_slots, context_lens, scale, out, window)`, which
    reads keys and values in place from their slots, and `prompt_attention(q, k_cache, v_cache,
    key_slots, first_len, scale, out, window)`, a chunk's rows each as decode_attention would;
    `window` > 0 limits each row to its last `window` keys (a sliding window), 0 to none."""

    write_kv: Callable[..., None]
    decode_attention: Callable[..., None]
    prompt_attention: Callable[..., None]


@dataclass(slots=True)
class DecodeGroup:
    num_seqs: int
    key_slots: torch.Tensor  # [B, L] cache slots of every key, padded
    key_mask: torch.Tensor | None  # [B, 1, 1, L] True where a key is real (SDPA path only)
    context_lens: torch.Tensor  # [B] keys per sequence


@dataclass(slots=True)
class PrefillChunk:
    token_start: int  # first row of this chunk in the flat batch
    num_tokens: int
    # [ctx] slots of the sequence's keys through the chunk's last token: with the CPU kernels
    # always, else when the chunk attends to earlier cached tokens
    key_slots: torch.Tensor | None
    mask: torch.Tensor | None  # [n, ctx] causal mask offset by the cached context (SDPA only)


@dataclass(slots=True)
class AttentionBatch:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    decode: DecodeGroup | None
    prefills: list[PrefillChunk]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    kernels: CacheKernels | None = None,
    window: int = 0,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]. Writes k/v to the cache, returns [T, H * D].
    window > 0: a query at position p attends to the keys at positions > p - window only
    (a sliding window, as transformers' sliding_window_overlay)."""
    if kernels is not None:
        kernels.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
    else:
        k_cache.index_copy_(0, batch.slot_mapping, k)
        v_cache.index_copy_(0, batch.slot_mapping, v)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if batch.decode is not None:
        n, group = batch.decode.num_seqs, batch.decode
        if kernels is not None:
            kernels.decode_attention(
                q[:n],
                k_cache,
                v_cache,
                group.key_slots,
                group.context_lens,
                scale,
                out[:n],
                window,
            )
        else:
            out[:n] = _decode(q[:n], k_cache, v_cache, group, scale, window)
    for chunk in batch.prefills:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        if kernels is not None:
            assert chunk.key_slots is not None, "the prompt kernel reads every key from the cache"
            first_len = chunk.key_slots.numel() - chunk.num_tokens + 1
            kernels.prompt_attention(
                q[rows], k_cache, v_cache, chunk.key_slots, first_len, scale, out[rows], window
            )
        else:
            out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale, window)
    return out.view(num_tokens, num_heads * head_dim)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    window: int,
) -> torch.Tensor:
    assert group.key_mask is not None, "the SDPA path needs the key mask"
    mask = group.key_mask
    if window > 0:
        key_pos = torch.arange(mask.shape[-1], device=mask.device)
        recent = key_pos.unsqueeze(0) >= (group.context_lens - window).unsqueeze(1)
        mask = mask & recent.view(mask.shape)
    batch, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    # Query heads sharing a KV head become that head's "query rows": no KV repeat needed.
    grouped_q = q.view(batch, kv_heads, num_heads // kv_heads, head_dim)
    keys = _gather(k_cache, group.key_slots).transpose(1, 2)
    values = _gather(v_cache, group.key_slots).transpose(1, 2)
    out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
    window: int,
) -> torch.Tensor:
    if chunk.key_slots is None:
        keys, values, mask, causal = k, v, None, True
    else:
        keys, values = _gather(k_cache, chunk.key_slots), _gather(v_cache, chunk.key_slots)
        mask, causal = chunk.mask, False
    if window > 0:
        mask, causal = _window_mask(q.shape[0], keys.shape[0], window, q.device), False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


def _window_mask(rows: int, ctx: int, window: int, device: torch.device) -> torch.Tensor:
    """[rows, ctx]: the chunk's last `rows` positions, each over its causal window."""
    query_pos = torch.arange(ctx - rows, ctx, device=device).unsqueeze(1)
    key_pos = torch.arange(ctx, device=device).unsqueeze(0)
    return (key_pos <= query_pos) & (key_pos > query_pos - window)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for a [..., L] slot tensor; index_select is the fast path on CPU."""
    flat = cache.index_select(0, slots.reshape(-1))
    return flat.view(*slots.shape, *cache.shape[1:])
