"""`QuantizedMatrix`: one linear weight in the form every quantized format
reduces to, before a kernel layout is chosen.

    w[n, k] = q[n, k] * scales[n, group[k]] + offsets[n, group[k]]

GPTQ and AWQ (w = (q - zero) * scale) give offsets = -zero * scale; GGUF's
Q4_1 (w = d * q + m) gives offsets = m; symmetric int8 (EETQ) stores q + 128.
Keeping one float offset rather than an integer zero point lets every format
be represented exactly. Act-order (GPTQ's desc_act) is just a `group` that is
not sorted."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..weights.errors import CheckpointError


@dataclass(frozen=True)
class QuantizedMatrix:
    """q [N, K] uint8 in [0, 2**bits); scales, offsets [N, G] float32;
    group [K] int64 in [0, G): the group of each input column."""

    q: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    group: torch.Tensor
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] the quantized values stand for."""
        (n, k), g = self.q.shape, self.scales.shape[1]
        if k % g == 0 and torch.equal(self.group, torch.arange(k) // (k // g)):
            # Consecutive groups: each group's scale broadcast over its columns (the
            # same products and sums as gathering them per column, without [N, K] copies).
            q = self.q.float().view(n, g, k // g)
            return (q * self.scales[..., None] + self.offsets[..., None]).view(n, k).to(dtype)
        return (self.q.float() * self.scales[:, self.group] + self.offsets[:, self.group]).to(dtype)

    def columns(self, start: int, stop: int) -> "QuantizedMatrix":
        """Input columns [start, stop) (a row-parallel rank's share), with
        only the groups those columns use, renumbered from 0."""
        group = self.group[start:stop]
        used, compact = torch.unique(group, sorted=True, return_inverse=True)  # used [G'], compact [stop - start]
        return QuantizedMatrix(self.q[:, start:stop].contiguous(), self.scales[:, used].contiguous(),
                               self.offsets[:, used].contiguous(), compact, self.bits)

    def rows(self, index: torch.Tensor | slice) -> "QuantizedMatrix":
        """Output rows `index` (a column-parallel slice or a row permutation)."""
        return QuantizedMatrix(self.q[index].contiguous(), self.scales[index].contiguous(),
                               self.offsets[index].contiguous(), self.group, self.bits)


def stack_rows(parts: list[QuantizedMatrix]) -> QuantizedMatrix:
    """Row-wise concatenation (q/k/v or gate/up merged into one GEMM); the
    parts must share their grouping of the input columns."""
    first = parts[0]
    if len(parts) == 1:
        return first
    for part in parts[1:]:
        if part.bits != first.bits or not torch.equal(part.group, first.group):
            raise CheckpointError("layers merged into one GEMM (q/k/v, gate/up) must share bits and g_idx")
    return QuantizedMatrix(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]),
                           torch.cat([p.offsets for p in parts]), first.group, first.bits)


# Range shrink factors tried by the MSE grid search (clipping outliers can lower the error).
SHRINK = tuple(1 - 0.025 * i for i in range(9))


def affine_grid(w: torch.Tensor, bits: int, symmetric: bool, min_zero: int = 0,
                search: bool = False, hessian: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, integer zero) [...] for groups w [..., size]: w ~ (q - zero) * scale.
    Symmetric: zero 2**(bits-1), scale absmax / (2**(bits-1) - 1). Asymmetric:
    the [min, max] range (0 included), zero in [min_zero, 2**bits - 1].
    search: also try the range shrunk by each SHRINK factor and keep, per
    group, the grid with the least squared error, or with hessian
    [G, size, size] (w [..., G, size]; the second moments of each group's
    inputs) the least output error d^T H d."""
    top = 2 ** bits - 1
    best = None
    lead = w.shape[:-1]  # [..., G]: the shape of what is returned
    if hessian is not None:  # [G, M, size]: each group's rows together, one bmm by its H_g a factor
        w = w.reshape(-1, *w.shape[-2:]).transpose(0, 1).contiguous()
    if symmetric:
        absmax = w.abs().amax(-1)
    else:
        low0, high0 = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    for factor in SHRINK if search else (1.0,):
        if symmetric:
            scale = (absmax * factor / (2 ** (bits - 1) - 1)).clamp(min=1e-12)
            zero = torch.full_like(scale, float(2 ** (bits - 1)))
        else:
            low, high = low0 * factor, high0 * factor
            scale = ((high - low) / top).clamp(min=1e-12)
            zero = torch.clamp(torch.round(-low / scale), min_zero, top)
        # In place after the first op: one [..., size] buffer instead of seven
        # (half the time of the AWQ scale search, which calls this ~10k times).
        s, z = scale[..., None], zero[..., None]
        diff = w.div(s).round_().add_(z).clamp_(0, top).sub_(z).mul_(s).sub_(w)  # dequantized - w
        err = (diff.pow_(2) if hessian is None else torch.bmm(diff, hessian).mul_(diff)).sum(-1)
        if best is None:
            best = (scale, zero, err)
        else:
            better = err < best[2]
            best = (torch.where(better, scale, best[0]), torch.where(better, zero, best[1]),
                    torch.minimum(err, best[2]))
    if hessian is not None:  # [G, M] -> [..., G]
        return best[0].transpose(0, 1).reshape(lead), best[1].transpose(0, 1).reshape(lead)
    return best[0], best[1]


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                 search: bool = False, hessian: torch.Tensor | None = None) -> QuantizedMatrix:
    """Round-to-nearest quantization of weight [N, K] with groups of
    `group_size` consecutive input columns (-1: one group per row) on the
    grid `affine_grid` picks (hessian [G, group_size, group_size]: see there)."""
    n, k = weight.shape
    size = k if group_size == -1 else group_size
    if k % size:
        raise ValueError(f"{k} input columns do not split into groups of {size}")
    w = weight.float().reshape(n, k // size, size)
    scale, zero = affine_grid(w, bits, symmetric, search=search, hessian=hessian)  # [N, G] each
    q = torch.clamp(torch.round(w / scale[..., None]) + zero[..., None], 0, 2 ** bits - 1)
    group = torch.arange(k) // size
    return QuantizedMatrix(q.reshape(n, k).to(torch.uint8), scale, -zero * scale, group, bits)
