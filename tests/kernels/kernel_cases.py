"""Random paged-attention inputs for the kernel tests, and a naive dense oracle.

A case holds, for each sequence, its full context K/V as plain contiguous tensors
(the truth) and the same values scattered into a paged cache through a shuffled
block table. Unused cache slots hold random garbage, so a kernel that reads past
a sequence's length or through a padding entry of the block table gives a wrong
answer instead of a lucky one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tgi_kernels import DecodeMeta, PrefillMeta, build_decode_meta, build_prefill_meta


@dataclass
class PagedCase:
    query: torch.Tensor  # [T, H, D] chunk queries, packed
    key: torch.Tensor  # [T, KVH, D] chunk keys, packed (also stored in the cache)
    value: torch.Tensor  # [T, KVH, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor
    prefill: PrefillMeta
    decode: DecodeMeta  # meaningful when every query length is 1
    contexts_k: list[torch.Tensor]  # per sequence [prefix + query, KVH, D]
    contexts_v: list[torch.Tensor]
    query_lens: list[int]
    prefix_lens: list[int]


def make_case(
    query_lens: list[int],
    prefix_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prefix_lens, query_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    shuffled = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for nb in blocks_per_seq:
        tables.append(shuffled[used : used + nb] + [0, 0])  # trailing padding entries point at block 0
        used += nb

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    k_cache = rand(num_blocks, block_size, kv_heads, head_dim)  # garbage everywhere at first
    v_cache = rand(num_blocks, block_size, kv_heads, head_dim)
    contexts_k = [rand(n, kv_heads, head_dim) for n in seq_lens]
    contexts_v = [rand(n, kv_heads, head_dim) for n in seq_lens]
    for table, k, v in zip(tables, contexts_k, contexts_v):
        pos = torch.arange(k.shape[0])
        blocks = torch.tensor(table, dtype=torch.long)[pos // block_size]
        k_cache[blocks, pos % block_size] = k
        v_cache[blocks, pos % block_size] = v

    return PagedCase(
        query=rand(sum(query_lens), heads, head_dim),
        key=torch.cat([k[p:] for k, p in zip(contexts_k, prefix_lens)]),
        value=torch.cat([v[p:] for v, p in zip(contexts_v, prefix_lens)]),
        k_cache=k_cache,
        v_cache=v_cache,
        prefill=build_prefill_meta(query_lens, prefix_lens, tables, device),
        decode=build_decode_meta(seq_lens, tables, device),
        contexts_k=contexts_k,
        contexts_v=contexts_v,
        query_lens=list(query_lens),
        prefix_lens=list(prefix_lens),
    )


def make_decode_case(seq_lens: list[int], **kwargs) -> PagedCase:
    """One query token per sequence, at position seq_len - 1."""
    return make_case([1] * len(seq_lens), [n - 1 for n in seq_lens], **kwargs)


def naive_attention(q, k, v, q_positions, scale, sliding_window=0, softcap=0.0) -> torch.Tensor:
    """Softmax attention written out score by score, in float64; softcap > 0:
    each score s capped to softcap * tanh(s / softcap).

    q [n, H, D]; k/v [m, KVH, D] for positions 0..m-1; q_positions: python ints.
    """
    n, heads, head_dim = q.shape
    group = heads // k.shape[1]
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(n, heads, head_dim, dtype=torch.float64)
    for i, p in enumerate(q_positions):
        visible = [j for j in range(k.shape[0]) if j <= p and (sliding_window == 0 or j > p - sliding_window)]
        for h in range(heads):
            kvh = h // group
            scores = [float(q[i, h] @ k[j, kvh]) * scale for j in visible]
            if softcap:
                scores = [softcap * math.tanh(s / softcap) for s in scores]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            for j, w in zip(visible, weights):
                out[i, h] += (w / total) * v[j, kvh]
    return out
