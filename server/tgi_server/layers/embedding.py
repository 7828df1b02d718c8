"""Token embedding and the LM head (optionally tied to the embedding)."""

import torch
from torch import nn
from torch.nn import functional as F

from ..weights.source import TensorSource
from .linear import Linear


class Embedding(nn.Module):
    """ids [T] -> [T, hidden]."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    @classmethod
    def load(cls, weights: TensorSource, prefix: str) -> "Embedding":
        return cls(weights.get(f"{prefix}.weight"))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """hidden [S, hidden] -> logits [S, vocab] in float32 (the sampler's dtype).

    Only the rows that sample or report logprobs reach it: with SmolLM2 the
    head is a fifth of all FLOPs, so it never runs on the whole batch."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.proj = Linear(weight, None)

    @classmethod
    def load(cls, weights: TensorSource, prefix: str, tied_to: Embedding | None) -> "LMHead":
        if tied_to is not None:
            return cls(tied_to.weight.data)
        return cls(weights.get(f"{prefix}.weight"))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden).float()
