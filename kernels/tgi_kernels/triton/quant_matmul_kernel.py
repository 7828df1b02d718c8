"""Triton kernels: weight-only quantized GEMM, y = x @ w.T, with the 4- or
8-bit weight dequantized inside the kernel.

The weight is the one QuantizedMatrix describes,

    w[n, k] = q[n, k] * scales[n, group[k]] + offsets[n, group[k]],

repacked once by `pack_quantized` into the layout the kernels stream: the
input dimension K outermost and N contiguous, so that a [BLOCK_K, BLOCK_N]
weight tile is BLOCK_K rows of contiguous bytes (coalesced, vectorised loads
along N):

    bits 8: packed [K, N] uint8, packed[k, n] = q[n, k]
    bits 4: packed [ceil(K/2), N] uint8, packed[i, n] = q[n, 2i] | q[n, 2i + 1] << 4
            (K odd: a zero column pads the last byte)
    scales, offsets [G, N] float32; group [K] int32

`quant_matmul` takes one of two paths by the number of rows M of x:

- fused (M <= FUSED_MAX_M: decode): `_quant_matmul_kernel`. Each program
  computes a [BLOCK_M, BLOCK_N] output tile over a range of K: it loads the x
  tile and the packed tile, unpacks and dequantizes it in float32, rounds it to
  x's dtype and multiplies with tl.dot, accumulating in float32. The weight is
  read once, at 1/4 (4-bit) or 1/2 (8-bit) of bf16's bytes. Group indices are
  read per input column, so an act-order (unsorted) `group` needs no
  permutation of x or of the weight; when every K tile lies in one group
  (consecutive groups of a multiple of BLOCK_K columns, or a single group), one
  row of scales/offsets [BLOCK_N] per tile, at a computed address (ALIGNED).
  With few output tiles (small N), K is split over several programs (split-K)
  that write float32 partials [S, M, N], summed afterwards in a fixed order.
- dequantize (M > FUSED_MAX_M: prefill, large batches): `_dequant_kernel`
  writes the weight, transposed, [K, N] in x's dtype, then torch.mm (cuBLAS).
  The fused kernel's tensor-core loop is far slower than cuBLAS at 64- and
  128-row tiles, so for many rows the weight's round trip through memory costs
  less (figures: docs/tuning.md#triton-quantized-gemm).

Imports triton at module level: load it through tgi_kernels.triton.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class QuantPacked:
    """A QuantizedMatrix in the kernel's layout (see the module docstring).
    All tensors on one device; in_features = K, out_features = N.

    group_size: the length of the runs of consecutive columns the groups form
    when group == arange(K) // group_size (the last group may be shorter; K
    for a single group), else 0 (act-order, uneven groups)."""

    packed: torch.Tensor   # bits 4: [ceil(K/2), N] uint8; bits 8: [K, N] uint8
    scales: torch.Tensor   # [G, N] float32
    offsets: torch.Tensor  # [G, N] float32
    group: torch.Tensor    # [K] int32 in [0, G)
    bits: int
    in_features: int
    out_features: int
    group_size: int

    def to(self, device: torch.device | str) -> "QuantPacked":
        """The same weight with its tensors on `device` (pack on the CPU, then move)."""
        return dataclasses.replace(self, **{name: getattr(self, name).to(device)
                                            for name in ("packed", "scales", "offsets", "group")})


class TileConfig(NamedTuple):
    """Tile sizes (powers of two, each >= 16 for tl.dot) and launch options."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Rows up to which quant_matmul runs the fused kernel; above, dequantize then torch.mm.
FUSED_MAX_M = 16
# The fused kernel's tiles by row count (a serving shard compiles few variants).
# Decode (M <= 16): one 16-row tile (tl.dot's minimum); narrow N tiles for many
# programs (reading the weight is the cost), long K tiles for more bytes in flight
# per program. The default path uses only this one.
DECODE = TileConfig(16, 32, 128, 4, 4)
# For the fused kernel forced on more rows (config=None, fused=True): correct, but
# slower than dequantize + torch.mm (docs/tuning.md#triton-quantized-gemm).
MEDIUM = TileConfig(64, 64, 64, 4, 3)
LARGE = TileConfig(128, 128, 64, 8, 3)
# Most splits of K: enough to fill the GPU at decode's small N (figures and why no more:
# docs/tuning.md#triton-quantized-gemm).
MAX_SPLIT_K = 4
# The dequantize kernel's tile [DEQUANT_BLOCK_K, DEQUANT_BLOCK_N] of the [K, N] weight.
DEQUANT_BLOCK_K, DEQUANT_BLOCK_N = 32, 128


@triton.jit(do_not_specialize=["M", "k_per_split"])
def _quant_matmul_kernel(
    x, packed, scales, offsets, group, out,
    M, N, K, k_per_split, stride_xm, group_size,
    BITS: tl.constexpr, ALIGNED: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Programs (n tile, m tile, k split): consecutive programs share an x row block.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows of x / out
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns (weight rows)
    rk = tl.arange(0, BLOCK_K)  # [BK]
    m_mask = rm < M
    n_mask = rn < N
    # A multiple of BLOCK_K (even: whole packed bytes); said so, so that loads stay vectorised.
    k_start = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
    k_end = tl.minimum(k_start + k_per_split, K)

    # Row offsets in int64 (M * K or K * N may pass 2**31); the per-tile offsets
    # below stay small and the pointers advance by a tile each iteration.
    x_ptrs = x + rm.to(tl.int64)[:, None] * stride_xm + (k_start + rk)[None, :]  # [BM, BK]
    if BITS == 4:
        # Column k is in byte row k // 2, low nibble for even k: each byte is loaded
        # for both of its columns (the second load hits the cache).
        w_ptrs = packed + (k_start // 2).to(tl.int64) * N + (rk // 2)[:, None] * N + rn[None, :]  # [BK, BN]
        shift = ((rk % 2) * 4)[:, None]  # [BK, 1]
    else:
        w_ptrs = packed + k_start.to(tl.int64) * N + rk[:, None] * N + rn[None, :]  # [BK, BN]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + rk  # [BK]
        # A tile never crosses its split's end (k_per_split is a multiple of BLOCK_K), so
        # k < K is the mask; against K, which triton knows to be a multiple of 16, the
        # loads stay vectorised (and pipelined).
        k_mask = k < K
        a = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        p = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0).to(tl.int32)  # [BK, BN]
        if BITS == 4:
            q = (p >> shift) & 0xF
        else:
            q = p
        if ALIGNED:
            # The whole tile is in group k0 // group_size: one row of scales. Computed,
            # not loaded from `group`: an address that depends on a load would hold the
            # software pipeline to one tile in flight.
            g = k0 // group_size
            s = tl.load(scales + g * N + rn, mask=n_mask, other=0.0)[None, :]  # [1, BN]
            o = tl.load(offsets + g * N + rn, mask=n_mask, other=0.0)[None, :]
        else:
            g = tl.load(group + k, mask=k_mask, other=0)  # [BK]
            sg = g[:, None] * N + rn[None, :]  # [BK, BN] (G * N is small: int32)
            s = tl.load(scales + sg, mask=n_mask[None, :], other=0.0)
            o = tl.load(offsets + sg, mask=n_mask[None, :], other=0.0)
        # Dequantize in float32, round once to x's dtype: the weight a dequantize-then-
        # linear in that dtype would use. Padding columns (k >= K) meet x = 0.
        w = (q.to(tl.float32) * s + o).to(a.dtype)  # [BK, BN]
        acc = tl.dot(a, w, acc, input_precision=PRECISION)  # [BM, BN] float32
        x_ptrs += BLOCK_K
        if BITS == 4:
            w_ptrs += (BLOCK_K // 2) * N
        else:
            w_ptrs += BLOCK_K * N

    o_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        # Partials [S, M, N] float32, summed by the caller.
        row = (pid_k * M + rm).to(tl.int64)  # [BM]
        tl.store(out + row[:, None] * N + rn[None, :], acc, mask=o_mask)
    else:
        tl.store(out + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(out.dtype.element_ty), mask=o_mask)


@triton.jit
def _dequant_kernel(
    packed, scales, offsets, group, out, N, K,
    BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program per [BLOCK_K, BLOCK_N] tile of the transposed weight out [K, N].
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    k_mask = rk < K
    n_mask = rn < N
    mask = k_mask[:, None] & n_mask[None, :]
    if BITS == 4:
        p = tl.load(packed + (rk // 2).to(tl.int64)[:, None] * N + rn[None, :], mask=mask, other=0).to(tl.int32)
        q = (p >> ((rk % 2) * 4)[:, None]) & 0xF  # [BK, BN]: low nibble for even k
    else:
        q = tl.load(packed + rk.to(tl.int64)[:, None] * N + rn[None, :], mask=mask, other=0).to(tl.int32)
    g = tl.load(group + rk, mask=k_mask, other=0)  # [BK]
    sg = g[:, None] * N + rn[None, :]  # [BK, BN] (G * N is small: int32)
    s = tl.load(scales + sg, mask=n_mask[None, :], other=0.0)
    o = tl.load(offsets + sg, mask=n_mask[None, :], other=0.0)
    w = q.to(tl.float32) * s + o  # as the fused kernel computes it, then the same rounding
    tl.store(out + rk.to(tl.int64)[:, None] * N + rn[None, :], w.to(out.dtype.element_ty), mask=mask)


def pack_quantized(
    q: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    group: torch.Tensor,
    bits: int,
) -> QuantPacked:
    """The kernel's layout of w[n, k] = q[n, k] * scales[n, group[k]] + offsets[n, group[k]].

    q [N, K] uint8 in [0, 2**bits); scales, offsets [N, G] float; group [K]
    int in [0, G), in any order; bits 4 or 8. Any K (odd K is padded for
    bits 4). The result is on q's device; pack once at load, not per call."""
    if bits not in (4, 8):
        raise ValueError(f"quant_matmul takes 4- or 8-bit weights, not {bits}-bit")
    if q.dtype != torch.uint8 or q.dim() != 2:
        raise ValueError(f"q must be a [N, K] uint8 tensor, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    g = scales.shape[1]
    if scales.shape != (n, g) or offsets.shape != (n, g) or group.shape != (k,):
        raise ValueError(f"scales/offsets must be [N, G] and group [K] for q {tuple(q.shape)}, got "
                         f"{tuple(scales.shape)}, {tuple(offsets.shape)}, {tuple(group.shape)}")
    device = q.device
    qt = q.t()  # [K, N]
    if bits == 4:
        if k % 2:
            qt = torch.cat([qt, qt.new_zeros(1, n)])
        packed = (qt[0::2] | (qt[1::2] << 4)).contiguous()  # [ceil(K/2), N]: even k low, odd k high
    else:
        packed = qt.contiguous()  # [K, N]
    group = group.to(device=device, dtype=torch.int64)
    size = int((group == 0).sum()) if k else 0
    consecutive = size > 0 and torch.equal(group, torch.arange(k, device=device) // size)
    return QuantPacked(
        packed=packed,
        scales=scales.t().to(device=device, dtype=torch.float32).contiguous(),
        offsets=offsets.t().to(device=device, dtype=torch.float32).contiguous(),
        group=group.to(torch.int32).contiguous(),
        bits=bits, in_features=k, out_features=n, group_size=size if consecutive else 0,
    )


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def tile_config(m: int, group_size: int = 0) -> TileConfig:
    """Tiles for M rows of x: decode, medium or large. With consecutive groups
    shorter than BLOCK_K (32, 64), BLOCK_K shrinks to the group so that each
    tile keeps one row of scales."""
    config = DECODE if m <= 16 else MEDIUM if m <= 64 else LARGE
    if 32 <= group_size < config.block_k and config.block_k % group_size == 0:
        config = config._replace(block_k=group_size)
    return config


def default_split_k(m: int, n: int, k: int, config: TileConfig, device: torch.device) -> int:
    """Splits of K for the fused kernel on CUDA when its output tiles would not
    occupy every multiprocessor (N 2048 at BLOCK_N 32: 64 tiles; figures:
    docs/tuning.md#triton-quantized-gemm), each split at least one K tile. 1
    otherwise, and off CUDA."""
    if device.type != "cuda":
        return 1
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    if tiles >= sms:
        return 1
    return max(1, min(triton.cdiv(sms, tiles), MAX_SPLIT_K, triton.cdiv(k, config.block_k)))


def dequantize_transposed(w: QuantPacked, dtype: torch.dtype) -> torch.Tensor:
    """The weight, transposed: [K, N] in `dtype` (w.T, as the fused kernel
    rounds it). For many rows of x, x @ this with torch.mm. A temporary of
    K * N * itemsize bytes per call (the caching allocator reuses it)."""
    k, n = w.in_features, w.out_features
    out = torch.empty(k, n, dtype=dtype, device=w.packed.device)
    if k and n:
        grid = (triton.cdiv(n, DEQUANT_BLOCK_N), triton.cdiv(k, DEQUANT_BLOCK_K))
        _dequant_kernel[grid](w.packed, w.scales, w.offsets, w.group, out, n, k,
                              BITS=w.bits, BLOCK_K=DEQUANT_BLOCK_K, BLOCK_N=DEQUANT_BLOCK_N)
    return out


def quant_matmul(
    x: torch.Tensor,
    w: QuantPacked,
    split_k: int | None = None,
    config: TileConfig | None = None,
    fused: bool | None = None,
) -> torch.Tensor:
    """x [M, K] float32/float16/bfloat16 (any strides) -> y = x @ dequantized(w).T
    [M, N] in x's dtype, accumulated in float32 (fp16/bf16: the weight rounded
    to x's dtype first, as a dequantize-then-linear in that dtype would).

    fused: the fused kernel (True) or dequantize + torch.mm (False); None:
    fused for M <= FUSED_MAX_M, or when split_k or config is given. For the
    fused kernel, split_k: programs over K per output tile (None:
    `default_split_k`) and config: tile sizes (None: `tile_config(M,
    w.group_size)`). The defaults suit serving; the options are for tests and
    tuning."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be [M, {w.in_features}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"quant_matmul takes float32/float16/bfloat16 activations, not {x.dtype}")
    m, k = x.shape
    n = w.out_features
    if fused is None:
        fused = m <= FUSED_MAX_M or split_k is not None or config is not None
    if not fused:
        return torch.mm(x, dequantize_transposed(w, x.dtype))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    config = config or tile_config(m, w.group_size)
    block_k = config.block_k
    k_tiles = triton.cdiv(k, block_k)
    splits = split_k if split_k is not None else default_split_k(m, n, k, config, x.device)
    splits = max(1, min(splits, k_tiles))
    per_split = triton.cdiv(k_tiles, splits)  # K tiles per split
    splits = triton.cdiv(k_tiles, per_split)  # none left empty
    aligned = w.group_size > 0 and (w.group_size % block_k == 0 or w.group_size >= k)
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), splits)
    _quant_matmul_kernel[grid](
        x, w.packed, w.scales, w.offsets, w.group, target,
        m, n, k, per_split * block_k, x.stride(0), min(w.group_size, k),
        BITS=w.bits, ALIGNED=aligned, SPLIT=splits > 1,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1:
        out.copy_(target.sum(dim=0))  # [S, M, N] -> [M, N], cast to x's dtype
    return out
