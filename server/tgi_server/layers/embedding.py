"""Token embedding and the LM head (optionally tied to the embedding), split
over the vocabulary under tensor parallelism.

The vocabulary is padded to a multiple of the world size and each rank holds
one contiguous block of rows of it (padding rows are zeros, on the last
ranks). At world size 1 the block is the whole vocabulary, unpadded."""

import torch
from torch import nn
from torch.nn import functional as F

from ..distributed import TensorParallel
from ..quant.gguf_linear import GGUFFormat
from ..quant.grouped_int8 import GroupedInt8
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
    summed. `scale` (gemma: sqrt(hidden)) multiplies the rows looked up, as
    a scalar in the weights' dtype, as transformers does."""

    def __init__(self, weight: torch.Tensor, start: int, tp: TensorParallel, name: str = "", scale: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [rows, hidden]
        self.start = start
        self.tp = tp
        self.name = name  # the checkpoint tensor it came from (a tied head reads its blocks)
        self.scale = None if scale == 1.0 else torch.tensor(scale, dtype=weight.dtype, device=weight.device)

    @classmethod
    def load(cls, weights: TensorSource, prefix: str, vocab_size: int, tp: TensorParallel,
             scale: float = 1.0) -> "Embedding":
        weight, start = _vocab_rows(weights, f"{prefix}.weight", vocab_size, tp)
        return cls(weight, start, tp, f"{prefix}.weight", scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            out = F.embedding(ids, self.weight)  # [T, hidden]
        else:
            local = ids - self.start  # [T]
            outside = (local < 0) | (local >= self.weight.shape[0])  # [T]
            out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
            out = self.tp.all_reduce_sum(out.masked_fill_(outside[:, None], 0))
        return out if self.scale is None else out.mul_(self.scale)


class LMHead(nn.Module):
    """hidden [S, hidden] -> logits [S, vocab] in float32 (the sampler's dtype),
    complete on every rank.

    Only the rows that sample or report logprobs reach it: with SmolLM2 the
    head is a fifth of all FLOPs, so it never runs on the whole batch.
    `gemv`: the same rows kept as int8 blocks (a GGUF head stored as Q8_0) for
    the steps where its kernel beats the dense GEMM (GroupedInt8.beats_dense);
    None elsewhere. `softcap` c (gemma): logits become
    c * tanh(logits / c)."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, tp: TensorParallel,
                 gemv: GroupedInt8 | None = None, softcap: float | None = None):
        super().__init__()
        self.proj = Linear(weight, None)  # [rows of this rank, hidden]
        self.gemv = gemv
        self.vocab_size = vocab_size
        self.tp = tp
        self.softcap = softcap

    @classmethod
    def load(cls, weights: TensorSource, prefix: str, vocab_size: int, tp: TensorParallel,
             tied_to: Embedding | None, softcap: float | None = None) -> "LMHead":
        """tied_to: the embedding whose rows (the same vocabulary block) are the head's."""
        name = tied_to.name if tied_to is not None else f"{prefix}.weight"
        weight = tied_to.weight.data if tied_to is not None else _vocab_rows(weights, name, vocab_size, tp)[0]
        return cls(weight, vocab_size, tp, _q8_0_head(weights, name, weight.shape[0], vocab_size, tp), softcap)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and self.gemv.beats_dense(hidden):
            logits = self.gemv(hidden)  # [S, rows]
        else:
            logits = self.proj(hidden)  # [S, rows]
        if self.tp.world_size > 1:
            # [S, padded vocab], ranks in order; the padding columns dropped
            logits = self.tp.all_gather(logits, dim=-1)[:, :self.vocab_size]
        logits = logits.float().contiguous()
        if self.softcap is not None:
            logits = torch.tanh(logits.div_(self.softcap)).mul_(self.softcap)
        return logits


def _q8_0_head(weights: TensorSource, name: str, rows: int, vocab_size: int,
               tp: TensorParallel) -> GroupedInt8 | None:
    """This rank's `rows` vocabulary rows of `name` as int8 blocks (zero past
    the vocabulary), when the checkpoint is a GGUF file storing it as Q8_0,
    the device is the CPU and our kernels are loaded; else None."""
    fmt = weights.linear_format
    if not isinstance(fmt, GGUFFormat) or weights.device.type != "cpu":
        return None
    start = tp.rank * rows
    blocks = fmt.q8_0_rows(name, start, max(start, min(start + rows, vocab_size)))
    if blocks is None:
        return None
    q, scales = blocks
    pad = rows - q.shape[0]
    return GroupedInt8.build(F.pad(q, (0, 0, 0, pad)), F.pad(scales, (0, 0, 0, pad)))
