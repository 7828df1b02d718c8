"""float8 KV caches (--kv-cache-dtype fp8_e4m3fn | fp8_e5m2).

A float8 cache holds key / k_scale and value / v_scale, rounded to nearest
even and saturated to the format's range (k_scale, v_scale: the layer's, from
the checkpoint, else 1). Every backend reads them back as their float
values: the cpu and triton kernels widen each row as they load it; sdpa,
the reference and flash_attn (whose kernels take 16-bit caches only) widen
the blocks they gather for a step, never the whole cache. The caller folds
the scales into the softmax scale and the output (layers/attention.py), so
no kernel takes a scale to read.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as the cache stores it: float8 of float(x) / scale, saturated (a
    plain cast overflows to NaN or infinity), or x cast to `dtype` (scale 1)."""
    if dtype not in FP8_KV_DTYPES:
        return x.to(dtype)
    top = torch.finfo(dtype).max
    return (x.float() * (1.0 / scale)).clamp_(-top, top).to(dtype)  # x.float() may be x itself
