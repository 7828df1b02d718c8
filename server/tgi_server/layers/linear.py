"""Dense linear layers, with merged variants that concatenate several
checkpoint matrices along the output dimension so one GEMM serves them all
(q/k/v, gate/up)."""

import torch
from torch import nn
from torch.nn import functional as F

from ..weights.source import TensorSource


class Linear(nn.Module):
    """y = x @ weight.T + bias; weight [out, in], x [T, in] -> [T, out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def load(cls, weights: TensorSource, prefix: str, bias: bool) -> "Linear":
        return cls.load_merged(weights, [prefix], bias)

    @classmethod
    def load_merged(cls, weights: TensorSource, prefixes: list[str], bias: bool) -> "Linear":
        """Concatenates `prefix.weight` (and `prefix.bias`) of each prefix along
        the output dimension: [sum(out_i), in]."""
        weight = _cat([weights.get(f"{p}.weight") for p in prefixes])
        b = _cat([weights.get(f"{p}.bias") for p in prefixes]) if bias else None
        return cls(weight, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
