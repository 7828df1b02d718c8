"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum layout) as QuantizedMatrix.

Per linear `prefix`: qweight int32 [K * bits / 32, N], qzeros int32
[G, N * bits / 32], scales fp16 [G, N], g_idx int32 [K] (optional; absent
means groups of consecutive columns). w[n, k] = scales[g, n] * (q[k, n] -
zero[g, n]) with g = g_idx[k]; the "gptq" (v1) format stores zero - 1."""

from dataclasses import dataclass

import torch

from ..weights.errors import CheckpointError
from .packing import unpack
from .quantized_matrix import QuantizedMatrix


@dataclass(frozen=True)
class GPTQFormat:
    """bits 4 or 8; group_size -1 = one group per row; zero_stored_minus_one
    for checkpoint_format "gptq" (v1), False for "gptq_v2"."""

    bits: int
    group_size: int
    zero_stored_minus_one: bool = True
    name: str = "gptq"

    def load(self, weights, prefix: str, dim: int, start: int, stop: int) -> QuantizedMatrix:
        """Output rows (dim 0) or input columns (dim 1) [start, stop) of `prefix`."""
        matrix = self.read(weights, prefix)
        return matrix.rows(slice(start, stop)) if dim == 0 else matrix.columns(start, stop)

    def read(self, weights, prefix: str) -> QuantizedMatrix:
        q = unpack(weights.get_raw(f"{prefix}.qweight"), self.bits, dim=0)          # [K, N]
        zeros = unpack(weights.get_raw(f"{prefix}.qzeros"), self.bits, dim=1).float()  # [G, N]
        scales = weights.get_raw(f"{prefix}.scales").float()                          # [G, N]
        k, n = q.shape
        if weights.has(f"{prefix}.g_idx"):
            group = weights.get_raw(f"{prefix}.g_idx").long()
        else:
            group = torch.arange(k) // (k if self.group_size == -1 else self.group_size)
        zeros = zeros[:, :n] + (1 if self.zero_stored_minus_one else 0)
        if scales.shape != zeros.shape or group.shape != (k,) or int(group.max()) >= scales.shape[0]:
            raise CheckpointError(f"{prefix}: GPTQ tensors disagree (qweight {tuple(q.shape)}, "
                                  f"scales {tuple(scales.shape)}, g_idx {tuple(group.shape)})")
        return QuantizedMatrix(q.T.contiguous(), scales.T.contiguous(), (-zeros * scales).T.contiguous(),
                               group, self.bits)
