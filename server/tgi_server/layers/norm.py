"""RMSNorm, alone and fused with the residual add before it."""

import torch
from torch import nn
from torch.nn import functional as F

from tgi_kernels import triton as triton_kernels
from tgi_kernels.native import native_ops

from ..weights.source import TensorSource


class RMSNorm(nn.Module):
    """y = weight * (x / rms(x)); x [T, hidden] -> [T, hidden] in x's dtype.
    Gemma's norms scale by 1 + w: `load(offset=True)` stores that sum (taken
    in float32, as Gemma does, then in the weights' dtype).

    On CPU our C++ kernel does it in one pass (F.rms_norm launches five
    kernels: docs/tuning.md#rmsnorm-kernel); on CUDA our Triton kernel does,
    the residual add included."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.native = native_ops() if weight.device.type == "cpu" else None
        self.triton = (weight.device.type == "cuda" and weight.dtype in triton_kernels.NORM_ACT_DTYPES
                       and triton_kernels.is_available(weight.device))

    @classmethod
    def load(cls, weights: TensorSource, prefix: str, eps: float, offset: bool = False) -> "RMSNorm":
        weight = weights.get(f"{prefix}.weight")
        return cls((weight.float() + 1.0).to(weight.dtype) if offset else weight, eps)

    def _fits(self, x: torch.Tensor) -> bool:
        return self.native is not None and x.dim() == 2 and x.dtype == self.weight.dtype

    def _fits_triton(self, x: torch.Tensor) -> bool:
        return self.triton and x.dim() == 2 and x.stride(-1) == 1 and x.dtype == self.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fits(x):
            return self.native.rms_norm(x, self.weight, self.eps)
        if self._fits_triton(x):
            return triton_kernels.rms_norm(x, self.weight, self.eps)
        # One fused op; identical to Hugging Face's float32 formula in float32.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x in place (residual [T, hidden], contiguous, owned by
        the caller's forward), then the norm of the sum: a pre-norm layer's
        `h = h + f(h); norm(h)` in one pass."""
        if self._fits(x):
            return self.native.add_rms_norm(x, residual, self.weight, self.eps)
        if self._fits_triton(x):
            return triton_kernels.rms_norm(x, self.weight, self.eps, residual)
        return self.forward(residual.add_(x))
