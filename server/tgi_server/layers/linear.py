"""Dense linear layers, with merged variants that concatenate several
checkpoint matrices along the output dimension so one GEMM serves them all
(q/k/v, gate/up)."""

import torch
from torch import nn
from torch.nn import functional as F

from ..weights.source import TensorSource

# oneDNN repacks a plain bf16 weight into its blocked layout on every call;
# packing once at load time made SmolLM2's linears 26% (batch 1) to 40%
# (batch 64) faster on a 2-core AMX CPU. The hint is the batch it tunes for.
PACK_BATCH_HINT = 32


def _can_prepack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear(nn.Module):
    """y = x @ weight.T + bias; weight [out, in], x [T, in] -> [T, out].

    bf16 weights on CPU are kept only in oneDNN's prepacked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        if _can_prepack(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
            self.weight = None
        else:
            self.packed = None
            self.weight = nn.Parameter(weight, requires_grad=False)

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
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
