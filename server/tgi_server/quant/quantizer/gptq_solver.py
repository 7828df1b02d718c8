"""GPTQ (Frantar et al., 2022): quantize a weight column by column, each
time spreading the rounding error over the columns not yet quantized in the
proportions the inverse Hessian of the layer's inputs gives, so that the
layer's outputs on the calibration data move as little as possible.

Each group's grid is the one (of affine_grid's searched ranges) with the
least output error on the calibration inputs, err = d^T H_g d with H_g the
group's diagonal block of H, rather than the least weight error: it clips
what the inputs rarely use (as AWQ's clipping search does)."""

import math

import torch

from ..quantized_matrix import QuantizedMatrix, affine_grid

BLOCK = 128     # columns updated together before the lazy update of the rest
INNER = 16      # within a block, columns updated by rank-1 steps before one GEMM updates the block's rest
DAMP = 0.01     # fraction of the mean diagonal added to H for stability


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int,
                  act_order: bool, symmetric: bool = True) -> QuantizedMatrix:
    """weight [N, K], hessian [K, K] = X^T X / n over the calibration inputs
    -> QuantizedMatrix; an asymmetric zero stays in [1, 2**bits - 1] so
    that GPTQ's v1 layout (zero - 1 stored) holds it.

    act_order: columns are quantized in order of decreasing H diagonal (the
    most-used inputs first). The groups stay consecutive original columns
    ("static groups"), their grids fixed up front from the weight, so
    `group` (the checkpoint's g_idx) is the plain k // group_size: kernels
    need no reordering, and grids stay aligned with the blocks of a
    block-quantized source (GGUF). Without act-order, each group's grid comes
    from its columns as they are when it is reached (earlier errors folded in)."""
    n, k = weight.shape
    size = k if group_size == -1 else group_size
    if k % size:
        raise ValueError(f"{k} input columns do not split into groups of {size} (pick a --group-size dividing it)")
    w = weight.float().clone()
    h = hessian.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    blocks = torch.stack([h[g:g + size, g:g + size] for g in range(0, k, size)])  # [G, size, size]
    scales = torch.zeros(n, k // size)
    zeros = torch.full((n, k // size), float(2 ** (bits - 1)))
    if act_order:
        scales, zeros = affine_grid(w.reshape(n, k // size, size), bits, symmetric, 1, search=True, hessian=blocks)
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    h += DAMP * torch.mean(torch.diag(h)) * torch.eye(k)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)  # [K, K]

    top = 2 ** bits - 1
    group = perm // size  # [K]: the group of each column in quantization order
    # A group's grid (without act-order) is fitted on its columns with every
    # earlier error folded in: groups start on inner-block boundaries.
    inner_cols = math.gcd(INNER, size)
    q = torch.zeros(n, k, dtype=torch.uint8)
    for start in range(0, k, BLOCK):
        stop = min(start + BLOCK, k)
        block = w[:, start:stop].clone()     # [N, B]
        errors = torch.zeros_like(block)     # [N, B]
        for i in range(stop - start):
            col = start + i
            if not act_order and col % size == 0:
                pending = torch.cat([block[:, i:], w[:, stop:]], dim=1)[:, None, :size]  # [N, 1, size]
                grid = affine_grid(pending, bits, symmetric, 1, search=True, hessian=blocks[col // size, None])
                scales[:, col // size], zeros[:, col // size] = grid[0][:, 0], grid[1][:, 0]
            scale, zero = scales[:, group[col]], zeros[:, group[col]]
            values = block[:, i].div(scale).round_().add_(zero).clamp_(0, top)
            q[:, col] = values
            err = errors[:, i]
            torch.sub(values, zero, out=err).mul_(scale).sub_(block[:, i]).div_(-hinv[col, col])
            # In place: the rank-1 update of the inner block's columns left;
            # the block's later columns get the inner block's errors at once,
            # by one GEMM, when it ends.
            inner_stop = min((i // inner_cols + 1) * inner_cols, stop - start)
            block[:, i:inner_stop].addr_(err, hinv[col, start + i:start + inner_stop], alpha=-1)
            if i + 1 == inner_stop and inner_stop < stop - start:
                lo = inner_stop - inner_cols
                later = hinv[start + lo:start + inner_stop, start + inner_stop:stop]
                block[:, inner_stop:] -= errors[:, lo:inner_stop] @ later
        w[:, stop:] -= errors @ hinv[start:stop, stop:]

    inverse = torch.argsort(perm)
    return QuantizedMatrix(q[:, inverse].contiguous(), scales, -zeros * scales, group[inverse], bits)
