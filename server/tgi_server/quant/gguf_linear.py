"""GGUF linears served from their quantized blocks: Q4_0, Q4_1 and Q4_K map
exactly onto a 4-bit QuantizedMatrix with groups of 32 (and so onto the
int4 GEMM), Q8_0 onto an 8-bit one (GroupedInt8's int8 kernel) where that
kernel serves the model's dtype; other block types (Q5_*, Q6_K, floats)
have no fast kernel for linears here and are dequantized to the serving
dtype as before
(a merged projection with one such part, as Q4_K_M files store some v and
down projections in Q6_K, is dequantized whole: layers/linear.py). A Q8_0
LM head (or tied embedding) also keeps its int8 blocks for the head's GEMV
(`q8_0_rows`, quant/grouped_int8.py).

Q4_0 block (18 bytes): d fp16, 16 bytes of nibbles; w = d * (q - 8).
Q4_1 block (20 bytes): d fp16, m fp16, 16 bytes of nibbles; w = d * q + m.
Byte j holds element j in its low nibble and element j + 16 in its high one.
Q4_K block (144 bytes, 256 elements: 8 groups of 32): d fp16, dmin fp16,
12 bytes of 6-bit scales sc and mins m (sc[j], m[j] the low 6 bits of bytes
j and j + 4 for j < 4; for j >= 4 the low and high nibbles of byte j + 4
below the top 2 bits of bytes j - 4 and j), then 128 bytes of nibbles: byte
32 c + l holds element 64 c + l in its low nibble and 64 c + 32 + l in its
high one; w = d * sc[j] * q - dmin * m[j] in group j.
Q8_0 block (34 bytes): d fp16, 32 int8 values; w = d * q."""

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ..weights.gguf import GGUFFile
from .grouped_int8 import GroupedInt8
from .quantized_matrix import QuantizedMatrix

BLOCK = 32
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}
_Q4_K_BYTES = 144
_Q8_0_BYTES = 34


@dataclass(frozen=True)
class GGUFFormat:
    file: GGUFFile
    name: str = "gguf"

    def load(self, weights, prefix: str, dim: int, start: int, stop: int) -> QuantizedMatrix | torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, stop) of `prefix.weight`:
        a QuantizedMatrix for Q4_0/Q4_1/Q4_K, and for Q8_0 where its int8
        kernel serves the model's dtype (whole blocks only), else a
        dequantized tensor."""
        name = f"{prefix}.weight"
        data, kind, row_order = self.file.blocks(name)
        if kind == GGMLQuantizationType.Q4_K:
            matrix = decode_q4_k(data)
        elif kind in _BLOCK_BYTES:
            matrix = decode_q4(data, kind)
        elif (kind == GGMLQuantizationType.Q8_0 and GroupedInt8.serves(weights.dtype, weights.device)
              and (dim == 0 or (start % BLOCK == 0 and stop % BLOCK == 0))):
            matrix = decode_q8_0(data)
        else:
            return weights.get_slice(name, dim, start, stop)
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
        return _q8_0(data[rows[start:stop]])


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


def decode_q4_k(data: np.ndarray) -> QuantizedMatrix:
    """Q4_K blocks [rows, bytes per row] uint8 -> QuantizedMatrix [rows, K]."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, _Q4_K_BYTES)  # [rows, K / 256, 144]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)     # [rows, K / 256]
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    low, high, nib = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]    # [rows, K / 256, 4] each
    sc = np.concatenate([low & 0x3F, (nib & 0x0F) | ((low >> 6) << 4)], axis=-1)  # [rows, K / 256, 8]
    m = np.concatenate([high & 0x3F, (nib >> 4) | ((high >> 6) << 4)], axis=-1)
    qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)  # [rows, K / 256, chunk c, 1, byte l]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, -1)  # element 64 c + 32 h + l
    scales = (d[..., None] * sc).reshape(rows, -1)  # [rows, K / 32]
    offsets = -(dmin[..., None] * m).reshape(rows, -1)
    k = q.shape[1]
    return QuantizedMatrix(torch.from_numpy(q), torch.from_numpy(scales), torch.from_numpy(offsets),
                           torch.arange(k) // BLOCK, 4)


def _q8_0(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks [rows, bytes per row] uint8 -> (q [rows, K] int8, d [rows, K / 32] float32)."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, _Q8_0_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, K / 32]
    q = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)             # [rows, K]
    return torch.from_numpy(q), torch.from_numpy(d)


def decode_q8_0(data: np.ndarray) -> QuantizedMatrix:
    """Q8_0 blocks -> QuantizedMatrix [rows, K] of 8 bits (q + 128, offsets -128 d)."""
    q, d = _q8_0(data)
    return QuantizedMatrix((q.to(torch.int16) + 128).to(torch.uint8), d, -128 * d,
                           torch.arange(q.shape[1]) // BLOCK, 8)
