"""float8 KV caches (--kv-cache-dtype fp8_e4m3fn | fp8_e5m2).

A float8 cache holds key / k_scale and value / v_scale, rounded to nearest
even and saturated to the format's range (k_scale, v_scale: the layer's, from
the checkpoint, else 1). Every backend reads them back as their float
values: the cpu and triton kernels widen each row as they load it; sdpa,
the reference and flash_attn (whose kernels take 16-bit caches only) widen
the blocks they gather for a step, never the whole cache. The caller folds
the scales into the softmax scale and the output (layers/attention.py), so
no kernel takes a scale to read.

Where a layer has no checkpoint scale, its queries and keys are turned by
`key_rotation` after RoPE before the keys are stored: q.k is unchanged, but
the few channels where both carry large values (the same channels in every
head and token) spread over the whole head, so e4m3's 3-bit mantissa errs on
every channel a little instead of on the dominant products a lot.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def key_rotation(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, float]:
    """(R [head_dim, head_dim], factor) with (q @ R) . (k @ R) = factor * (q . k).

    R is block-diagonal: Sylvester's Hadamard matrix on each block of n
    channels, n = the largest power of two dividing head_dim (64, 128, 256:
    one block; 96: three of 32). Its entries are +-2^-floor(log2(n) / 2),
    exact in every float dtype, so R R^T = factor * I with factor 1 (n an
    even power of two) or 2 (odd): the caller divides the softmax scale by
    it, exactly."""
    n = head_dim & -head_dim
    bits = n.bit_length() - 1
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    h = h * 2.0 ** -(bits // 2)
    return torch.block_diag(*[h] * (head_dim // n)).to(device=device, dtype=dtype), float(2 ** (bits % 2))


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as the cache stores it: float8 of float(x) / scale, saturated (a
    plain cast overflows to NaN or infinity), or x cast to `dtype` (scale 1)."""
    if dtype not in FP8_KV_DTYPES:
        return x.to(dtype)
    top = torch.finfo(dtype).max
    return (x.float() * (1.0 / scale)).clamp_(-top, top).to(dtype)  # x.float() may be x itself
