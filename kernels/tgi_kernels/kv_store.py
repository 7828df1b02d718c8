"""Writing new keys and values into the paged KV cache (float8 caches: fp8.py)."""

from __future__ import annotations

import torch

from . import cpu
from . import triton as triton_backend
from .fp8 import FP8_KV_DTYPES, to_cache_dtype


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write token t's key/value into slot `slot_mapping[t]` of the cache, in place.

    key/value [T, KVH, D]; k_cache/v_cache [num_blocks, block_size, KVH, D], contiguous;
    slot_mapping [T] int64 with slot = block_id * block_size + offset. Every slot must be
    valid (no negative padding slots) and distinct. Values are cast to the cache dtype
    (to_cache_dtype, with k_scale / v_scale where the cache is float8).
    backend "triton" writes with the Triton kernel; any other name uses torch.
    """
    if backend == "triton":
        triton_backend.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    kv_heads, head_dim = k_cache.shape[2:]
    key, value = to_cache_dtype(key, k_cache.dtype, k_scale), to_cache_dtype(value, v_cache.dtype, v_scale)
    k_flat = k_cache.view(-1, kv_heads, head_dim)  # [num_blocks * block_size, KVH, D]
    v_flat = v_cache.view(-1, kv_heads, head_dim)
    if k_cache.dtype in FP8_KV_DTYPES:  # torch has no index_copy_ for float8: copy the bytes
        k_flat, v_flat, key, value = (t.view(torch.uint8) for t in (k_flat, v_flat, key, value))
    k_flat.index_copy_(0, slot_mapping, key)
    v_flat.index_copy_(0, slot_mapping, value)


def fuses_rotary(backend: str | None, key_rotation: bool = False) -> bool:
    """True when `backend` rotates and stores in one pass (rotary_store_kv),
    turning queries and keys by fp8.key_rotation too where `key_rotation`."""
    return backend == "cpu" if key_rotation else backend in ("cpu", "triton")


def rotary_store_kv(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, num_heads: int,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: float = 1.0, v_scale: float = 1.0, backend: str = "cpu",
                    key_rotation: bool = False) -> None:
    """The rotary embedding and store_kv in one pass, for backends where
    fuses_rotary: rotates the query and key heads of qkv [T, H + 2 KVH, D]
    (contiguous) in place (x * cos + roll(x, D/2) * signed_sin; cos/signed_sin
    [T, 1, D]), then stores its key and value heads at slot_mapping [T]
    (valid, distinct slots). The cache in qkv's dtype, or float8 (as store_kv
    writes it). key_rotation (fuses_rotary(backend, True)): the rotated heads
    are then multiplied by fp8.key_rotation(D)'s matrix, in qkv and in the
    cache. One kernel launch on triton (CUDA), where the torch path takes
    five: this runs in every layer of every step."""
    if backend == "triton":
        assert not key_rotation, "triton's rotary_store_kv does not turn keys (fuses_rotary)"
        triton_backend.rotary_store_kv(qkv, cos, signed_sin, num_heads, k_cache, v_cache, slot_mapping,
                                       k_scale, v_scale)
        return
    cpu.rotary_store_kv(qkv, cos, signed_sin, num_heads, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                        key_rotation)
