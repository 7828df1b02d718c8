"""Fast attention on top of torch's scaled_dot_product_attention (the CPU serving path).

Decode is batched: the blocks of every sequence are gathered into one dense
[B, L, KVH, D] tensor (one index_select, faster than advanced indexing) and
attended with a boolean length mask. The G query heads sharing a KV head are
folded into SDPA's query-length axis ([B, KVH, G, D]), so GQA needs neither
repeat_interleave nor enable_gqa: the fastest layout (figures and what else
was tried: docs/tuning.md#sdpa-backend-layouts).

Prefill loops over sequences (it is compute bound) and calls SDPA once each,
with is_causal when nothing but the chunk is visible and an explicit mask when
a cached prefix or a sliding window is involved. GQA there uses enable_gqa,
faster than repeat_interleave copies.

SDPA has no soft cap: with softcap > 0 (gemma2) the same layouts go through
`_capped` instead, the scores written out, capped, masked and softmaxed.
Requirement: every slot of the KV cache holds a finite value (allocate it with
torch.zeros, not torch.empty). Masked positions get probability 0, but 0 * NaN
is still NaN in the value matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import DecodeMeta, PrefillMeta


def gather_blocks(cache: torch.Tensor, ids: torch.Tensor, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """The blocks `ids` [B * num_blocks] (each sequence's first num_blocks,
    row after row) of cache [num_cache_blocks, block_size, KVH, D] as one
    dense tensor [B, num_blocks * block_size, KVH, D] in `dtype` (a copy,
    contiguous; a float8 cache's blocks widened once gathered)."""
    _, block_size, kv_heads, head_dim = cache.shape
    dense = cache.index_select(0, ids).to(dtype)  # [B * num_blocks, block_size, KVH, D]
    return dense.view(batch, -1, kv_heads, head_dim)


def decode_block_ids(meta: DecodeMeta, block_size: int) -> torch.Tensor:
    """[B * num_blocks] block ids covering every sequence's longest context."""
    num_blocks = -(-meta.max_seq_len // block_size)
    return meta.block_tables[:, :num_blocks].reshape(-1)


def _capped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float) -> torch.Tensor:
    """Attention with softly capped scores: q [B, H, n, D], k/v [B, KVH, m, D]
    (query head h reads kv head h // (H // KVH)), mask broadcastable to
    [B, H, n, m] (True: attend) -> [B, H, n, D]; the softmax in float32."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, H, m, D]
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, H, n, m]
    scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMeta,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """query [B, H, D] -> out [B, H, D]; see tgi_kernels.paged_decode."""
    batch, heads, head_dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if batch == 0:
        return torch.empty_like(query)
    ids, mask = _decode_layout(meta, block_size, sliding_window)
    k = gather_blocks(k_cache, ids, batch, query.dtype).transpose(1, 2)  # [B, KVH, L, D]
    v = gather_blocks(v_cache, ids, batch, query.dtype).transpose(1, 2)  # [B, KVH, L, D]
    if softcap > 0:
        return _capped(query[:, :, None], k, v, mask, scale, softcap).reshape(batch, heads, head_dim)
    # Query heads h = kvh * G + g share KV head kvh: fold g into the query-length axis.
    q = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)  # [B, KVH, G, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, KVH, G, D]
    return out.reshape(batch, heads, head_dim)


def _decode_layout(meta: DecodeMeta, block_size: int, sliding_window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block ids to gather [B * num_blocks], key mask [B, 1, 1, L]), built once
    per step and window and shared by every layer through meta.derived.

    The query sits at position seq_len - 1 and sees keys j with
    seq_len - window <= j < seq_len."""
    key = ("sdpa_decode", block_size, sliding_window)
    if key not in meta.derived:
        ids = decode_block_ids(meta, block_size)
        pos = torch.arange(ids.numel() // meta.block_tables.shape[0] * block_size, device=ids.device)  # [L]
        seq_lens = meta.seq_lens.to(torch.int64)[:, None]  # [B, 1]
        mask = pos[None, :] < seq_lens  # [B, L]
        if sliding_window > 0:
            mask &= pos[None, :] >= seq_lens - sliding_window
        meta.derived[key] = (ids, mask[:, None, None, :])
    return meta.derived[key]


def _read_prefix(cache: torch.Tensor, block_table: torch.Tensor, start_block: int, prefix: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """Cached KV of positions start_block * block_size .. prefix - 1 of one sequence.

    cache [num_cache_blocks, block_size, KVH, D]; block_table [max_blocks].
    Returns [prefix - start_block * block_size, KVH, D] in `dtype`.
    """
    block_size = cache.shape[1]
    end_block = -(-prefix // block_size)
    dense = cache.index_select(0, block_table[start_block:end_block]).to(dtype)  # [nb, block_size, KVH, D]
    return dense.flatten(0, 1)[: prefix - start_block * block_size]


def _prefill_one(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix: int,
    scale: float,
    sliding_window: int,
    softcap: float,
) -> torch.Tensor:
    """Attention of one sequence's chunk: query [n, H, D], key/value [n, KVH, D] -> [n, H, D]."""
    # SDPA gets 4-D inputs: on CPU, 3-D ones miss the flash kernel and run far slower
    # (docs/tuning.md#sdpa-backend-layouts).
    q = query.transpose(0, 1)[None]  # [1, H, n, D]
    if prefix == 0 and sliding_window == 0 and softcap == 0:
        k, v = key.transpose(0, 1)[None], value.transpose(0, 1)[None]  # [1, KVH, n, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)  # [1, H, n, D]
        return out[0].transpose(0, 1)

    # Keys older than the window of the chunk's first query are never read.
    block_size = k_cache.shape[1]
    first_visible = max(0, prefix - sliding_window + 1) if sliding_window > 0 else 0
    start_block = first_visible // block_size
    k_start = start_block * block_size  # absolute position of the first key read
    if prefix > k_start:
        key = torch.cat([_read_prefix(k_cache, block_table, start_block, prefix, key.dtype), key])  # [m, KVH, D]
        value = torch.cat([_read_prefix(v_cache, block_table, start_block, prefix, value.dtype), value])

    q_pos = prefix + torch.arange(query.shape[0], device=query.device)  # [n]
    k_pos = k_start + torch.arange(key.shape[0], device=query.device)  # [m]
    mask = k_pos[None, :] <= q_pos[:, None]  # [n, m]
    if sliding_window > 0:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    k, v = key.transpose(0, 1)[None], value.transpose(0, 1)[None]  # [1, KVH, m, D]
    if softcap > 0:
        out = _capped(q, k, v, mask, scale, softcap)  # [1, H, n, D]
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def varlen_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PrefillMeta,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D] -> out [T, H, D]; see tgi_kernels.varlen_prefill."""
    out = torch.empty_like(query)  # [T, H, D]
    start = 0
    for b, (n, prefix) in enumerate(zip(meta.query_lens, meta.prefix_lens_list)):
        end = start + n
        out[start:end] = _prefill_one(
            query[start:end], key[start:end], value[start:end],
            k_cache, v_cache, meta.block_tables[b], prefix, scale, sliding_window, softcap,
        )
        start = end
    return out
