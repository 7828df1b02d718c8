"""Triton kernel: write each token's key and value into its paged-cache slot.

Imports triton at module level: load it through tgi_kernels.triton, which
imports it only when the triton backend is used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8 import FP8_KV_DTYPES


@triton.jit
def _store_kv_kernel(
    key, value, k_cache, v_cache, slot_mapping,
    stride_kt, stride_kh, stride_vt, stride_vh, k_inv_scale, v_inv_scale,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8_MAX: tl.constexpr,
):
    # One program per token; it copies that token's [KVH, D] key and value
    # (FP8_MAX > 0: a float8 cache, which holds them over their scales, saturated).
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot >= 0:  # a negative slot marks a padding token (CUDA graph replay): nothing to write
        h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
        d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
        mask = (h < KV_HEADS) & (d < HEAD_DIM)
        # The cache is contiguous: slot s starts at s * KVH * D in either tensor.
        dst = slot * KV_HEADS * HEAD_DIM + h * HEAD_DIM + d
        k = tl.load(key + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value + t * stride_vt + h * stride_vh + d, mask=mask)
        if FP8_MAX > 0:
            k = tl.clamp(k.to(tl.float32) * k_inv_scale, -FP8_MAX, FP8_MAX)
            v = tl.clamp(v.to(tl.float32) * v_inv_scale, -FP8_MAX, FP8_MAX)
        tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=mask)
        tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key/value [T, KVH, D] (last dim contiguous); k_cache/v_cache [num_blocks,
    block_size, KVH, D] contiguous; slot_mapping [T] int. Same contract as
    tgi_kernels.store_kv, except that negative slots are skipped."""
    tokens = key.shape[0]
    if tokens == 0:
        return
    kv_heads, head_dim = k_cache.shape[2:]
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    _store_kv_kernel[(tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), 1.0 / k_scale, 1.0 / v_scale,
        KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_MAX=torch.finfo(k_cache.dtype).max if k_cache.dtype in FP8_KV_DTYPES else 0.0,
    )
