"""GGUF linears served from their quantized blocks: Q4_0 and Q4_1 map
exactly onto a 4-bit QuantizedMatrix with groups of 32 (and so onto the
int4 GEMM); other block types (Q8_0, K-quants, floats) have no fast kernel
for linears here and are dequantized to the serving dtype as before. A Q8_0
LM head (or tied embedding) also keeps its int8 blocks for the head's GEMV
(`q8_0_rows`, quant/grouped_int8.py).

Q4_0 block (18 bytes): d fp16, 16 bytes of nibbles; w = d * (q - 8).
Q4_1 block (20 bytes): d fp16, m fp16, 16 bytes of nibbles; w = d * q + m.
Byte j holds element j in its low nibble and element j + 16 in its high one.
Q8_0 block (34 bytes): d fp16, 32 int8 values; w = d * q."""

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ..weights.gguf import GGUFFile
from .quantized_matrix import QuantizedMatrix

BLOCK = 32
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}
_Q8_0_BYTES = 34


@dataclass(frozen=True)
class GGUFFormat:
    file: GGUFFile
    name: str = "gguf"

    def load(self, weights, prefix: str, dim: int, start: int, stop: int) -> QuantizedMatrix | torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, stop) of `prefix.weight`:
        a QuantizedMatrix for Q4_0/Q4_1, else a dequantized tensor."""
        name = f"{prefix}.weight"
        data, kind, row_order = self.file.blocks(name)
        if kind not in _BLOCK_BYTES:
            return weights.get_slice(name, dim, start, stop)
        matrix = decode_q4(data, kind)
        if row_order is not None:
            matrix = matrix.rows(torch.from_numpy(row_order))
        return matrix.rows(slice(start, stop)) if dim == 0 else matrix.columns(start, stop)

    def q8_0_rows(self, name: str, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rows [start, stop) of tensor `name` when it is stored as Q8_0: (q
        [rows, K] int8, scales [rows, K / 32] float32), w = scales * q per
        group of 32 columns; None for any other block type."""
        data, kind, row_order = self.file.blocks(name)
        if kind != GGMLQuantizationType.Q8_0:
            return None
        rows = np.arange(data.shape[0]) if row_order is None else row_order
        blocks = np.ascontiguousarray(data[rows[start:stop]]).reshape(stop - start, -1, _Q8_0_BYTES)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, K / 32]
        q = blocks[..., 2:].copy().view(np.int8).reshape(stop - start, -1)       # [rows, K]
        return torch.from_numpy(q), torch.from_numpy(d)


def decode_q4(data: np.ndarray, kind: GGMLQuantizationType) -> QuantizedMatrix:
    """Q4_0 / Q4_1 blocks [rows, bytes per row] uint8 -> QuantizedMatrix [rows, K]."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, _BLOCK_BYTES[kind])  # [rows, K / 32, bytes]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)    # [rows, K / 32]
    if kind == GGMLQuantizationType.Q4_1:
        offsets = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., 4:]
    else:
        offsets = -8 * d
        nibbles = blocks[..., 2:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1)  # [rows, K]
    k = q.shape[1]
    return QuantizedMatrix(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(offsets),
                           torch.arange(k) // BLOCK, 4)
