"""AWQ checkpoints (AutoAWQ's GEMM layout, version "gemm") as QuantizedMatrix.

Per linear `prefix`: qweight int32 [K, N / 8] and qzeros int32 [G, N / 8],
both packed along the output dimension in AWQ's interleaved order; scales
fp16 [G, N]; groups are consecutive input columns. w = (q - zero) * scale."""

from dataclasses import dataclass

import torch

from ..weights.errors import CheckpointError
from .packing import awq_unpack
from .quantized_matrix import QuantizedMatrix


@dataclass(frozen=True)
class AWQFormat:
    group_size: int
    bits: int = 4
    name: str = "awq"

    def load(self, weights, prefix: str, dim: int, start: int, stop: int) -> QuantizedMatrix:
        """Output rows (dim 0) or input columns (dim 1) [start, stop) of `prefix`."""
        matrix = self.read(weights, prefix)
        return matrix.rows(slice(start, stop)) if dim == 0 else matrix.columns(start, stop)

    def read(self, weights, prefix: str) -> QuantizedMatrix:
        q = awq_unpack(weights.get_raw(f"{prefix}.qweight"))              # [K, N]
        zeros = awq_unpack(weights.get_raw(f"{prefix}.qzeros")).float()   # [G, N]
        scales = weights.get_raw(f"{prefix}.scales").float()              # [G, N]
        k = q.shape[0]
        size = k if self.group_size == -1 else self.group_size
        if scales.shape != zeros.shape or scales.shape[0] * size != k:
            raise CheckpointError(f"{prefix}: AWQ tensors disagree (qweight {tuple(q.shape)}, "
                                  f"scales {tuple(scales.shape)}, group size {self.group_size})")
        return QuantizedMatrix(q.T.contiguous(), scales.T.contiguous(), (-zeros * scales).T.contiguous(),
                               torch.arange(k) // size, 4)
