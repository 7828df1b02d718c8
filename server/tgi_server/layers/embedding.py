"""Token embedding and the LM head (optionally tied to the embedding), split
over the vocabulary under tensor parallelism.

The vocabulary is padded to a multiple of the world size and each rank holds
one contiguous block of rows of it (padding rows are zeros, on the last
ranks). At world size 1 the block is the whole vocabulary, unpadded."""

import torch
from torch import nn
from torch.nn import functional as F

from ..distributed import TensorParallel
from ..weights.source import TensorSource
from .linear import Linear


def _vocab_rows(weights: TensorSource, name: str, vocab_size: int, tp: TensorParallel) -> tuple[torch.Tensor, int]:
    """(this rank's rows of `name` [ceil(vocab / world_size), hidden], zero-padded
    past the vocabulary, and the vocabulary id of its first row)."""
    rows = -(-vocab_size // tp.world_size)
    start = tp.rank * rows
    stop = min(start + rows, vocab_size)
    weight = weights.get_slice(name, 0, start, max(start, stop))  # [real rows, hidden]
    if weight.shape[0] < rows:
        weight = torch.cat([weight, weight.new_zeros(rows - weight.shape[0], weight.shape[1])])
    return weight, start


class Embedding(nn.Module):
    """ids [T] -> [T, hidden].

    Holds the rows of vocabulary ids [start, start + rows); under tensor
    parallelism the other ids give zeros here and the ranks' outputs are
    summed."""

    def __init__(self, weight: torch.Tensor, start: int, tp: TensorParallel):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [rows, hidden]
        self.start = start
        self.tp = tp

    @classmethod
    def load(cls, weights: TensorSource, prefix: str, vocab_size: int, tp: TensorParallel) -> "Embedding":
        weight, start = _vocab_rows(weights, f"{prefix}.weight", vocab_size, tp)
        return cls(weight, start, tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start  # [T]
        outside = (local < 0) | (local >= self.weight.shape[0])  # [T]
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        return self.tp.all_reduce_sum(out.masked_fill_(outside[:, None], 0))


class LMHead(nn.Module):
    """hidden [S, hidden] -> logits [S, vocab] in float32 (the sampler's dtype),
    complete on every rank.

    Only the rows that sample or report logprobs reach it: with SmolLM2 the
    head is a fifth of all FLOPs, so it never runs on the whole batch."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, tp: TensorParallel):
        super().__init__()
        self.proj = Linear(weight, None)  # [rows of this rank, hidden]
        self.vocab_size = vocab_size
        self.tp = tp

    @classmethod
    def load(cls, weights: TensorSource, prefix: str, vocab_size: int, tp: TensorParallel,
             tied_to: Embedding | None) -> "LMHead":
        """tied_to: the embedding whose rows (the same vocabulary block) are the head's."""
        if tied_to is not None:
            return cls(tied_to.weight.data, vocab_size, tp)
        return cls(_vocab_rows(weights, f"{prefix}.weight", vocab_size, tp)[0], vocab_size, tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.proj(hidden)  # [S, rows]
        if self.tp.world_size > 1:
            # [S, padded vocab], ranks in order; the padding columns dropped
            logits = self.tp.all_gather(logits, dim=-1)[:, :self.vocab_size]
        return logits.float().contiguous()
