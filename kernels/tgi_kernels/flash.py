"""flash-attn backend (CUDA, fp16/bf16), used only when the `flash_attn` package imports.

flash-attn 2 reads a paged cache only when the block size is a multiple of 256
("Paged KV cache block size must be divisible by 256"). For smaller blocks
(our default is 16) the needed blocks are first gathered into dense tensors on
the device, without any host synchronisation, and the dense kernels are used.

Prefill with a cached prefix reads the whole context, chunk included, from the
cache: the caller stores the chunk with store_kv before calling, as the
contract of varlen_prefill requires.

flash-attn's causal mask is aligned to the bottom right (the last query sees the
last key), which is our convention: query i of a chunk sits at prefix + i. Its
window (left, 0) lets query i see keys i - left .. i, so a Mistral sliding
window W maps to left = W - 1.

Queries in float32 fall back to the sdpa backend: flash-attn has no fp32 kernel.
flash-attn 2 reads 16-bit caches only: a float8 cache's blocks take the
gathered path, widened to the query's dtype as they are gathered (a copy of
the step's blocks, as for small blocks; with a cached prefix the chunk's own
keys are then read back rounded, where other backends use the step's; the
triton backend reads float8 in place, and is the default on CUDA for such a
cache).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from . import sdpa
from .metadata import DecodeMeta, PrefillMeta

PAGED_BLOCK_MULTIPLE = 256  # flash-attn 2 reads a paged cache only for block sizes divisible by this
_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _flash() -> ModuleType | None:
    try:
        import flash_attn
    except (ImportError, OSError):  # OSError: a wheel built for another CUDA/torch
        return None
    return flash_attn


def is_available(device: torch.device) -> bool:
    """True on CUDA devices when `flash_attn` imports."""
    return device.type == "cuda" and _flash() is not None


def _window(sliding_window: int) -> tuple[int, int]:
    return (sliding_window - 1, 0) if sliding_window > 0 else (-1, -1)


def _softcap(softcap: float) -> dict:
    """flash-attn's `softcap` argument (2.6 and later), passed only when set."""
    return {"softcap": softcap} if softcap else {}


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
    if query.dtype not in _DTYPES or query.shape[0] == 0:
        return sdpa.paged_decode(query, k_cache, v_cache, meta, scale, sliding_window, softcap)
    block_size = k_cache.shape[1]
    common = dict(cache_seqlens=meta.seq_lens, softmax_scale=scale, causal=True, window_size=_window(sliding_window),
                  **_softcap(softcap))
    q = query.unsqueeze(1)  # [B, 1, H, D]
    if block_size % PAGED_BLOCK_MULTIPLE == 0 and k_cache.dtype == query.dtype:
        out = _flash().flash_attn_with_kvcache(q, k_cache, v_cache, block_table=meta.block_tables, **common)
    else:
        ids = sdpa.decode_block_ids(meta, block_size)
        batch = query.shape[0]
        k = sdpa.gather_blocks(k_cache, ids, batch, query.dtype)  # [B, L, KVH, D]
        v = sdpa.gather_blocks(v_cache, ids, batch, query.dtype)  # [B, L, KVH, D]
        out = _flash().flash_attn_with_kvcache(q, k, v, **common)  # [B, 1, H, D]
    return out.squeeze(1)


def gather_contexts(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PrefillMeta, dtype: torch.dtype):
    """Whole context (prefix + chunk) of every sequence, packed, read from the cache.

    Returns k, v [sum(prefix + query), KVH, D] in `dtype` and cu_seqlens_k [B+1] int32.
    Everything stays on the device: sizes come from the python lists in `meta`.
    """
    batch = len(meta.query_lens)
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    device = k_cache.device
    total = sum(meta.query_lens) + sum(meta.prefix_lens_list)
    seq_lens = meta.prefix_lens + (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1])  # [B]
    cu_seqlens_k = F.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0))  # [B+1]
    seq_idx = torch.repeat_interleave(
        torch.arange(batch, device=device), seq_lens, output_size=total
    )  # [total]
    pos = torch.arange(total, device=device) - cu_seqlens_k[seq_idx]  # [total] position within its sequence
    blocks = meta.block_tables[seq_idx, pos // block_size].long()  # [total]
    slots = blocks * block_size + pos % block_size  # [total]
    k = k_cache.view(-1, kv_heads, head_dim).index_select(0, slots).to(dtype)  # [total, KVH, D]
    v = v_cache.view(-1, kv_heads, head_dim).index_select(0, slots).to(dtype)
    return k, v, cu_seqlens_k


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
    if query.dtype not in _DTYPES or query.shape[0] == 0:
        return sdpa.varlen_prefill(query, key, value, k_cache, v_cache, meta, scale, sliding_window, softcap)
    common = dict(softmax_scale=scale, causal=True, window_size=_window(sliding_window), **_softcap(softcap))
    if not any(meta.prefix_lens_list):
        cu, n = meta.cu_seqlens_q, meta.max_query_len
        return _flash().flash_attn_varlen_func(query, key, value, cu, cu, n, n, **common)
    k, v, cu_seqlens_k = gather_contexts(k_cache, v_cache, meta, query.dtype)
    return _flash().flash_attn_varlen_func(
        query, k, v, meta.cu_seqlens_q, cu_seqlens_k, meta.max_query_len, meta.max_seq_len, **common
    )
