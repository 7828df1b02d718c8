"""RMSNorm."""

import torch
from torch import nn
from torch.nn import functional as F

from ..weights.source import TensorSource


class RMSNorm(nn.Module):
    """y = weight * (x / rms(x)); x [T, hidden] -> [T, hidden] in x's dtype."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    @classmethod
    def load(cls, weights: TensorSource, prefix: str, eps: float) -> "RMSNorm":
        return cls(weights.get(f"{prefix}.weight"), eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op; identical to Hugging Face's float32 formula in float32.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
