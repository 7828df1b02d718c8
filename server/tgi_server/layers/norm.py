"""RMSNorm, computed in float32 like Hugging Face's LlamaRMSNorm."""

import torch
from torch import nn

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
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)
