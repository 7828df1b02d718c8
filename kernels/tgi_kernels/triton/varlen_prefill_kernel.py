"""Triton kernel: causal attention of a ragged batch of chunks after cached prefixes.

One program per (sequence, kv head, tile of query tokens): its BLOCK_M rows
are TILE_TOKENS tokens x the GROUP query heads sharing the kv head, so each
key tile is read once for the whole group (GQA). Keys
come from two places: positions before the sequence's prefix_len from the
paged cache through its block table, and the chunk's own positions from the
packed key/value tensors (so a batch without prefixes never touches the cache).
Tiles of query rows past the end of a sequence return at once; the grid is
sized by the longest chunk.

Imports triton at module level: load it through tgi_kernels.triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .softmax_tile import attend_tile

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    query, key, value, k_cache, v_cache, cu_seqlens_q, prefix_lens, block_tables, out,
    qk_scale, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + b)
    q_len = tl.load(cu_seqlens_q + b + 1) - q_start
    if tile * TILE_TOKENS < q_len:
        prefix = tl.load(prefix_lens + b)
        r = tl.arange(0, BLOCK_M)  # [BM] row = token-in-tile * GROUP + head-in-group
        i = tile * TILE_TOKENS + r // GROUP  # [BM] query index within the chunk
        h = kvh * GROUP + r % GROUP  # [BM] query head
        i_mask = (r < TILE_TOKENS * GROUP) & (i < q_len)
        q_pos = prefix + i  # [BM] absolute positions
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        q = tl.load(query + (q_start + i)[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                    mask=i_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        q = q * qk_scale  # [BM, BD]

        # Keys this tile may see: from the first query's window start to the last valid query.
        hi = prefix + tl.minimum((tile + 1) * TILE_TOKENS, q_len)
        # (one int32 expression: a compiled kernel needs one type for lo on both sides of an if)
        lo = tl.where(window > 0, tl.maximum(prefix + tile * TILE_TOKENS - window + 1, 0), 0)
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # 1) the cached prefix, positions [lo, prefix), through the block table
        for start in range(lo, prefix, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)  # [BN] absolute key positions
            n_mask = n < prefix
            block = tl.load(block_tables + b * stride_bt + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            row = ((block * BLOCK_SIZE + n % BLOCK_SIZE) * KV_HEADS + kvh) * HEAD_DIM  # [BN]
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_cache + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_cache + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            visible = i_mask[:, None] & n_mask[None, :]  # [BM, BN]; prefix keys precede every query
            if window > 0:
                visible = visible & (n[None, :] > q_pos[:, None] - window)
            m, row_sum, acc = attend_tile(q, k, v, visible, m, row_sum, acc, PRECISION)

        # 2) the chunk itself, positions [max(lo, prefix), hi), from the packed key/value
        for start in range(tl.maximum(lo, prefix), hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_mask = n < hi
            t = q_start + (n - prefix)  # [BN] rows of the packed batch
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(key + t[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                        mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(value + t[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                        mask=kv_mask, other=0.0).to(tl.float32)
            visible = i_mask[:, None] & n_mask[None, :] & (n[None, :] <= q_pos[:, None])
            if window > 0:
                visible = visible & (n[None, :] > q_pos[:, None] - window)
            m, row_sum, acc = attend_tile(q, k, v, visible, m, row_sum, acc, PRECISION)

        res = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(out + (q_start + i)[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :],
                 res.to(out.dtype.element_ty), mask=i_mask[:, None] & d_mask[None, :])


def varlen_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int = 0,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D] (last dims contiguous); caches
    [num_blocks, block_size, KVH, D] contiguous; cu_seqlens_q [B+1], prefix_lens
    [B], block_tables [B, W] int32; max_query_len a host-side bound on every
    chunk's length. Returns out [T, H, D] in query's dtype."""
    tokens, heads, head_dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(query)
    batch = cu_seqlens_q.shape[0] - 1
    if tokens == 0 or batch == 0:
        return out
    query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
    group = heads // kv_heads
    block_m = max(block_m, triton.next_power_of_2(group))
    tile_tokens = block_m // group  # e.g. 64 rows = 21 tokens x 3 heads (one row unused)
    grid = (batch, kv_heads, triton.cdiv(max_query_len, tile_tokens))
    _prefill_kernel[grid](
        query, key, value, k_cache, v_cache, cu_seqlens_q, prefix_lens, block_tables, out,
        scale * LOG2E, sliding_window,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        TILE_TOKENS=tile_tokens, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
    )
    return out
