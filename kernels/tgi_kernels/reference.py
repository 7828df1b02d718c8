"""Reference attention in plain torch: one sequence at a time, explicit masks, float32.

This is the oracle the other backends are tested against. It favours being
obviously right over being fast: it syncs with the device, copies K/V per
sequence and expands GQA heads with repeat_interleave.
"""

from __future__ import annotations

import torch

from .metadata import DecodeMeta, PrefillMeta


def read_context(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, n: int,
                 dtype: torch.dtype | None = None):
    """K/V of absolute positions 0..n-1 of one sequence, read through its block table.

    k_cache/v_cache [num_blocks, block_size, KVH, D]; block_table [max_blocks].
    Returns two [n, KVH, D] tensors (copies) in `dtype` (default: the cache's;
    a float8 cache's values read as they are).
    """
    block_size = k_cache.shape[1]
    blocks = block_table[: -(-n // block_size)].long()  # [ceil(n / block_size)]
    k = k_cache[blocks].flatten(0, 1)[:n]  # [n, KVH, D]
    v = v_cache[blocks].flatten(0, 1)[:n]
    return (k, v) if dtype is None else (k.to(dtype), v.to(dtype))


def attention_mask(q_pos: torch.Tensor, num_keys: int, sliding_window: int) -> torch.Tensor:
    """Boolean [n, num_keys] mask: query at absolute position i sees key j iff i - window < j <= i."""
    k_pos = torch.arange(num_keys, device=q_pos.device)  # [num_keys]
    allowed = k_pos[None, :] <= q_pos[:, None]  # [n, num_keys]
    if sliding_window > 0:
        allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return allowed


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Masked softmax attention of one sequence, computed in float32.

    q [n, H, D]; k/v [m, KVH, D] for absolute positions 0..m-1; q_pos [n] absolute
    positions of the queries. Returns [n, H, D] in q's dtype.
    """
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [m, H, D]
    v = v.float().repeat_interleave(group, dim=1)  # [m, H, D]
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k) * scale  # [H, n, m]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    mask = attention_mask(q_pos, k.shape[0], sliding_window)  # [n, m]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [H, n, m]
    out = torch.einsum("hnm,mhd->nhd", probs, v)  # [n, H, D]
    return out.to(q.dtype)


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
    out = torch.empty_like(query)  # [B, H, D]
    for b, n in enumerate(meta.seq_lens.tolist()):
        k, v = read_context(k_cache, v_cache, meta.block_tables[b], n)
        q_pos = torch.tensor([n - 1], device=query.device)
        out[b] = attend(query[b : b + 1], k, v, q_pos, scale, sliding_window, softcap)[0]
    return out


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
    starts = meta.cu_seqlens_q.tolist()
    for b, (n, prefix) in enumerate(zip(meta.query_lens, meta.prefix_lens_list)):
        s, e = starts[b], starts[b] + n
        k, v = key[s:e], value[s:e]  # [n, KVH, D]
        if prefix > 0:
            k_prefix, v_prefix = read_context(k_cache, v_cache, meta.block_tables[b], prefix, key.dtype)
            k = torch.cat([k_prefix, k])  # [prefix + n, KVH, D]
            v = torch.cat([v_prefix, v])
        q_pos = prefix + torch.arange(n, device=query.device)  # [n]
        out[s:e] = attend(query[s:e], k, v, q_pos, scale, sliding_window, softcap)
    return out
