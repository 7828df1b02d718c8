"""Triton kernel: paged decode attention (one query token per sequence).

One program per (sequence, kv head, split): it handles the G query heads
that share the kv head together, so each key tile is read once for all of
them (GQA). Long contexts are cut into splits of `partition` tokens that run
in parallel (flash-decoding); a second small kernel merges the splits' partial
softmaxes. Block tables are followed token by token, so a key tile may span
several cache blocks and any power-of-two block size works.

Imports triton at module level: load it through tgi_kernels.triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .softmax_tile import attend_tile

LOG2E = 1.4426950408889634
DEFAULT_PARTITION = 512  # tokens per split; a sequence shorter than this runs in one program
# Tokens per split where a step has too few (sequence, kv head) programs to fill
# the GPU: more, shorter splits then keep more multiprocessors busy; with many
# sequences DEFAULT_PARTITION stays fastest (figures: docs/tuning.md#triton-decode-partitions).
NARROW_PARTITION = 128
NARROW_PROGRAMS = 32  # fewer (sequence, kv head) programs than this: NARROW_PARTITION
BLOCK_N = 64  # keys per tile
MERGE_BLOCK = 8  # splits merged per iteration


# The number of splits follows the longest context of the step: a runtime value, so
# that a serving shard compiles two variants (one split, several) rather than one
# per context length.
@triton.jit(do_not_specialize=["window", "num_splits"])
def _decode_kernel(
    query, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_ml,
    qk_scale, window, num_splits,
    stride_qb, stride_qh, stride_bt, stride_ob, stride_oh,
    GROUP: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PARTITION: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)  # [BG] query heads of this kv head (padded to a dot-able size)
    d = tl.arange(0, BLOCK_D)  # [BD]
    head = kvh * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(query + b * stride_qb + head[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    q = q * qk_scale  # [BG, BD]

    seq_len = tl.load(seq_lens + b)
    lo = split * PARTITION
    hi = tl.minimum(lo + PARTITION, seq_len)
    if window > 0:  # the query at seq_len - 1 sees keys j > seq_len - 1 - window
        lo = tl.maximum(lo, seq_len - window)

    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # [BN] absolute key positions
        n_mask = n < hi
        block = tl.load(block_tables + b * stride_bt + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        # Contiguous cache [num_blocks, BLOCK_SIZE, KVH, D]: row of key n, this kv head.
        row = ((block * BLOCK_SIZE + n % BLOCK_SIZE) * KV_HEADS + kvh) * HEAD_DIM  # [BN]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)  # [BN, BD]
        v = tl.load(v_cache + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        visible = g_mask[:, None] & n_mask[None, :]  # [BG, BN]
        m, row_sum, acc = attend_tile(q, k, v, visible, m, row_sum, acc, PRECISION)

    if not SPLIT:
        res = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(out + b * stride_ob + head[:, None] * stride_oh + d[None, :],
                 res.to(out.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        # Partials: part_out [B, H, S, BD] unnormalised; part_ml [B, H, S, 2] (max, sum).
        row_h = (b * KV_HEADS * GROUP + head) * num_splits + split  # [BG]
        tl.store(part_out + row_h[:, None] * BLOCK_D + d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_ml + row_h * 2, m, mask=g_mask)
        tl.store(part_ml + row_h * 2 + 1, row_sum, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_out, part_ml, out, stride_ob, stride_oh, num_splits,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # One program per (sequence, query head): merge its num_splits partial softmaxes,
    # BLOCK_S at a time, with the same running rescaling as the attention itself.
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)  # [BD]
    m_run = tl.max(tl.full([BLOCK_S], float("-inf"), dtype=tl.float32), axis=0)  # a float32 scalar
    sum_run = tl.sum(tl.zeros([BLOCK_S], dtype=tl.float32), axis=0)
    acc_run = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)  # [BS]
        s_mask = s < num_splits
        row = (b * HEADS + h) * num_splits + s  # [BS]
        m = tl.load(part_ml + row * 2, mask=s_mask, other=float("-inf"))
        split_sum = tl.load(part_ml + row * 2 + 1, mask=s_mask, other=0.0)
        acc = tl.load(part_out + row[:, None] * BLOCK_D + d[None, :], mask=s_mask[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        # Splits that saw no key (past the end, or before a sliding window) have m = -inf: weight 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_run - m_safe)
        w = tl.math.exp2(m - m_safe)  # [BS]
        sum_run = sum_run * alpha + tl.sum(split_sum * w, axis=0)
        acc_run = acc_run * alpha + tl.sum(acc * w[:, None], axis=0)  # [BD]
        m_run = m_new
    res = acc_run / sum_run
    tl.store(out + b * stride_ob + h * stride_oh + d, res.to(out.dtype.element_ty), mask=d < HEAD_DIM)


def num_splits(max_seq_len: int, partition: int) -> int:
    """Splits needed so that every context of up to max_seq_len tokens is covered."""
    return max(1, -(-max_seq_len // partition))


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    sliding_window: int = 0,
    partition: int | None = None,
) -> torch.Tensor:
    """query [B, H, D] (last dim contiguous); k_cache/v_cache [num_blocks,
    block_size, KVH, D] contiguous; block_tables [B, W] int32; seq_lens [B]
    int32 >= 1. Every seq_len must be <= max_seq_len, a host-side bound that
    only sets the number of splits (no device synchronisation). `partition` a
    multiple of BLOCK_N (None: by the batch, see NARROW_PARTITION). Returns
    out [B, H, D] in query's dtype."""
    batch, heads, head_dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if partition is None:
        partition = NARROW_PARTITION if batch * kv_heads < NARROW_PROGRAMS else DEFAULT_PARTITION
    group = heads // kv_heads
    out = torch.empty_like(query)
    if batch == 0:
        return out
    query = query if query.stride(-1) == 1 else query.contiguous()
    splits = num_splits(max_seq_len, partition)
    block_d = max(16, triton.next_power_of_2(head_dim))
    part_out = part_ml = out  # unused placeholders when there is one split
    if splits > 1:
        part_out = torch.empty(batch, heads, splits, block_d, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(batch, heads, splits, 2, dtype=torch.float32, device=query.device)
    _decode_kernel[(batch, kv_heads, splits)](
        query, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_ml,
        scale * LOG2E, sliding_window, splits,
        query.stride(0), query.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=BLOCK_N,
        PARTITION=partition, SPLIT=splits > 1,
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
    )
    if splits > 1:
        _merge_splits_kernel[(batch, heads)](
            part_out, part_ml, out, out.stride(0), out.stride(1), splits,
            HEADS=heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=MERGE_BLOCK,
        )
    return out
