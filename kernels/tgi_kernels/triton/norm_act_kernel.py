"""Triton kernels for the per-token work between a layer's GEMMs on CUDA:
RMSNorm (alone, and after the residual add) and the gated activations.

In eager torch each is two to five kernels (F.rms_norm, residual.add_,
silu then mul); in a decode step they are a large share of the kernels and of
the GPU time, almost all launch latency (figures:
docs/tuning.md#triton-norm-and-activation). One launch each here, with the
same rounding as the torch ops they replace: sums and products in float32,
rounded to the activations' dtype where torch rounds.

Imports triton at module level: load it through tgi_kernels.triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x, residual, weight, out, stride_x, stride_r, stride_o, eps,
                     N: tl.constexpr, BLOCK_N: tl.constexpr, ADD: tl.constexpr):
    # One program per row. ADD: residual += x first (rounded to its dtype, as
    # `residual.add_(x)`), and the norm is of that sum.
    row = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    ok = n < N
    h = tl.load(x + row * stride_x + n, mask=ok, other=0.0)
    if ADD:
        h = (h.to(tl.float32) + tl.load(residual + row * stride_r + n, mask=ok, other=0.0).to(tl.float32)).to(h.dtype)
        tl.store(residual + row * stride_r + n, h, mask=ok)
    h = h.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / N + eps)
    w = tl.load(weight + n, mask=ok).to(tl.float32)
    tl.store(out + row * stride_o + n, (h * inv_rms * w).to(out.dtype.element_ty), mask=ok)


@triton.jit
def _gated_act_kernel(gate_up, out, stride_g, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr, GELU: tl.constexpr):
    # Program (row, column block): act(gate) * up of gate_up's row [gate (INTER) | up (INTER)].
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < INTER
    g = tl.load(gate_up + row * stride_g + col, mask=ok, other=0.0)
    u = tl.load(gate_up + row * stride_g + INTER + col, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    if GELU:  # the tanh approximation, with tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (gf + 0.044715 * gf * gf * gf)
        a = gf * tl.sigmoid(2.0 * z)  # 0.5 x (1 + tanh(z))
    else:
        a = gf * tl.sigmoid(gf)
    # act(gate) is rounded to the dtype before the product, as torch's two ops do.
    tl.store(out + row * stride_o + col, (a.to(g.dtype).to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)


def _warps(n: int) -> int:
    return 4 if n <= 2048 else 8 if n <= 8192 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, N] (rows contiguous) -> weight * x / rms(x) [T, N] in x's dtype; with
    residual [T, N] (contiguous, x's dtype): residual += x in place first, and
    the norm is of the sum."""
    tokens, n = x.shape
    out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(tokens,)](
        x, x if residual is None else residual, weight, out, x.stride(0),
        0 if residual is None else residual.stride(0), out.stride(0), eps,
        N=n, BLOCK_N=block, ADD=residual is not None, num_warps=_warps(block))
    return out


def gated_act(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """gate_up [T, 2 I] (rows contiguous) -> act(gate) * up [T, I]; act "silu" or "gelu_tanh"."""
    tokens, width = gate_up.shape
    inter = width // 2
    out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _gated_act_kernel[(tokens, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), INTER=inter, BLOCK=block, GELU=act == "gelu_tanh",
        num_warps=4)
    return out
