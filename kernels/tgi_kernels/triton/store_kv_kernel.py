"""Triton kernels: write each token's key and value into its paged-cache slot,
alone or after rotating its query and key heads (RoPE) in place.

Imports triton at module level: load it through tgi_kernels.triton, which
imports it only when the triton backend is used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8 import FP8_KV_DTYPES


@triton.jit
def _write_slot(k_cache, v_cache, dst, k, v, mask, k_inv_scale, v_inv_scale, FP8_MAX: tl.constexpr):
    # One token's key and value tiles into the cache at offsets dst (FP8_MAX > 0:
    # a float8 cache, which holds them over their scales, saturated).
    if FP8_MAX > 0:
        k = tl.clamp(k.to(tl.float32) * k_inv_scale, -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) * v_inv_scale, -FP8_MAX, FP8_MAX)
    tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    key, value, k_cache, v_cache, slot_mapping,
    stride_kt, stride_kh, stride_vt, stride_vh, k_inv_scale, v_inv_scale,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8_MAX: tl.constexpr,
):
    # One program per token; it copies that token's [KVH, D] key and value.
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
        _write_slot(k_cache, v_cache, dst, k, v, mask, k_inv_scale, v_inv_scale, FP8_MAX)


def _fp8_max(cache: torch.Tensor) -> float:
    """The kernels' FP8_MAX for a cache: its largest value where it is float8, else 0.0 (no scaling)."""
    return torch.finfo(cache.dtype).max if cache.dtype in FP8_KV_DTYPES else 0.0


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
        FP8_MAX=_fp8_max(k_cache),
    )


@triton.jit
def _rotate(at, d, partner, c, s, mask):
    # x * cos + roll(x, D/2) * signed_sin for the heads at `at`, in place, each
    # product rounded to x's dtype, then their sum: Hugging Face's
    # x * cos + rotate_half(x) * sin, operation by operation. Returns it.
    x = tl.load(at + d, mask=mask)
    x_roll = tl.load(at + partner, mask=mask)
    rotated = ((x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
               + (x_roll.to(tl.float32) * s).to(x.dtype).to(tl.float32)).to(x.dtype)
    tl.store(at + d, rotated, mask=mask)
    return rotated


@triton.jit
def _rotary_store_kv_kernel(
    qkv, cos, sin, k_cache, v_cache, slot_mapping,
    stride_t, stride_ct, stride_st, k_inv_scale, v_inv_scale,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr, FP8_MAX: tl.constexpr,
):
    # One program per token: rotates its query and key heads in place (heads of
    # qkv [T, HEADS + 2 KV_HEADS, HEAD_DIM], each HEAD_DIM contiguous), then
    # stores the rotated key and the value at the token's slot.
    t = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    d_ok = d < HEAD_DIM
    partner = (d + HEAD_DIM // 2) % HEAD_DIM  # roll(x, D/2)[d] = x[(d + D/2) % D]
    c = tl.load(cos + t * stride_ct + d, mask=d_ok).to(tl.float32)
    s = tl.load(sin + t * stride_st + d, mask=d_ok).to(tl.float32)
    row = qkv + t * stride_t

    hq = tl.arange(0, BLOCK_Q)[:, None]  # [BLOCK_Q, 1]
    _rotate(row + hq * HEAD_DIM, d, partner, c, s, (hq < HEADS) & d_ok)
    hk = tl.arange(0, BLOCK_KV)[:, None]  # [BLOCK_KV, 1]
    k_ok = (hk < KV_HEADS) & d_ok
    k = _rotate(row + (HEADS + hk) * HEAD_DIM, d, partner, c, s, k_ok)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot >= 0:  # a negative slot marks a padding token: nothing to write
        v = tl.load(row + (HEADS + KV_HEADS + hk) * HEAD_DIM + d, mask=k_ok)
        dst = slot * KV_HEADS * HEAD_DIM + hk * HEAD_DIM + d
        _write_slot(k_cache, v_cache, dst, k, v, k_ok, k_inv_scale, v_inv_scale, FP8_MAX)


def rotary_store_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """qkv [T, H + 2 KVH, D] contiguous; cos/signed_sin [T, 1, D] (last dim
    contiguous); caches and slots as store_kv. Same contract as
    tgi_kernels.rotary_store_kv, except that negative slots are skipped (their
    query and key heads still rotate)."""
    tokens = qkv.shape[0]
    if tokens == 0:
        return
    kv_heads, head_dim = k_cache.shape[2:]
    cos, signed_sin = cos.reshape(tokens, head_dim), signed_sin.reshape(tokens, head_dim)
    _rotary_store_kv_kernel[(tokens,)](
        qkv, cos, signed_sin, k_cache, v_cache, slot_mapping,
        qkv.stride(0), cos.stride(0), signed_sin.stride(0), 1.0 / k_scale, 1.0 / v_scale,
        HEADS=num_heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_Q=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_MAX=_fp8_max(k_cache),
    )
