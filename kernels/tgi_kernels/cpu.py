"""The cpu backend: our C++ kernels (csrc/, built by tgi_kernels.native),
the CPU's default wherever they build.

Decode reads every sequence's blocks in place (no gather, no padding to
the longest context): one task per (sequence, kv head), the G query heads
of a kv head sharing each K/V row read, online softmax across blocks.
Prefill runs every chunk of a step in one call, the same way (tiles of
query rows, the prefix read in place, the chunk's own keys from the step's
rows). The rotary embedding and the KV store are one pass
(`rotary_store_kv`), which the attention layer calls instead of its
rotate-then-store pair when `fuses_rotary(backend)`.
"""

from __future__ import annotations

import torch

from . import sdpa
from .fp8 import FP8_KV_DTYPES
from .metadata import DecodeMeta, PrefillMeta
from .native import native_ops


def is_available(device: torch.device) -> bool:
    """True on the CPU when the C++ kernels built (or were cached) here."""
    return torch.device(device).type == "cpu" and native_ops() is not None


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMeta,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """query [B, H, D] -> out [B, H, D]; see tgi_kernels.paged_decode. The
    cache in query's dtype or float8 (read in place, widened row by row)."""
    if query.dtype != k_cache.dtype and k_cache.dtype not in FP8_KV_DTYPES:
        return sdpa.paged_decode(query, k_cache, v_cache, meta, scale, sliding_window, softcap)
    return native_ops().paged_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                     sliding_window, softcap)


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
    """query [T, H, D], key/value [T, KVH, D] -> out [T, H, D]; see tgi_kernels.varlen_prefill.
    All chunks in one call of our kernel (csrc/prefill.cpp; built where the CPU
    has AVX2 or AVX-512) when the cache is in query's dtype or float8, else
    SDPA a sequence at a time."""
    ops = native_ops()
    reads_cache = query.dtype == k_cache.dtype or k_cache.dtype in FP8_KV_DTYPES
    if (reads_cache and query.dtype != torch.float64 and query.shape[-1] % 16 == 0
            and hasattr(ops, "varlen_prefill")):
        return ops.varlen_prefill(query, key, value, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                  meta.prefix_lens, scale, sliding_window, softcap)
    return sdpa.varlen_prefill(query, key, value, k_cache, v_cache, meta, scale, sliding_window, softcap)


def rotary_store_kv(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, num_heads: int,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: float = 1.0, v_scale: float = 1.0, key_rotation: bool = False) -> None:
    """In place: rotates the query and key heads of qkv [T, H + 2 KVH, D]
    (x * cos + roll(x, D/2) * signed_sin, cos/signed_sin [T, 1, D] in qkv's
    dtype), turns them by fp8.key_rotation(D) where key_rotation (a
    Walsh-Hadamard transform, not a matmul), then writes its key and value
    heads into the caches [num_blocks, block_size, KVH, D] (qkv's dtype, or
    float8 holding key / k_scale and value / v_scale) at slot_mapping [T] int64."""
    native_ops().rotary_store_kv(qkv, cos, signed_sin, num_heads, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                                 key_rotation)
