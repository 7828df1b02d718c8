"""`GroupedInt8`: y = x @ w.T for a few rows of x, with w = scale * q held as
int8 values and one float scale per row and group of columns (GGUF's Q8_0),
on our C++ GEMV (csrc/int8_gemv.cpp).

It serves the LM head of a GGUF file whose head is Q8_0, as SmolLM2's tied
token embedding is: at one row it reads 30 MB where the dense bf16 head
reads 56 MB (figures: docs/tuning.md#grouped-int8-head); and, where the int8
activations below run (`serves`), a GGUF file's Q8_0 linears
(QuantLinear's "grouped_int8"). Two kernels:
- bf16 / fp16 activations on AVX512-VNNI: x quantized to int8 per 32
  columns (llama.cpp's Q8_0 x Q8_0 product) and summed in integers, 64
  products an instruction. It beats the dense bf16 GEMM at every row count,
  so the head takes it for every step.
- elsewhere, x in float and the int8 values widened: one multiply-add per
  weight and row, float32 exact to rounding; past GEMV_MAX_ROWS rows the
  dense GEMM wins and the head keeps it for them."""

import torch
from torch import nn

from tgi_kernels.native import native_ops

from .quantized_matrix import QuantizedMatrix

LANES = 16  # output rows a block of the kernel's layout holds
# Rows up to which the GEMV beats oneDNN's prepacked bf16 GEMM at SmolLM2's head
# [49152, 576]: reading half the bytes wins until the dense GEMM's arithmetic does
# (figures: docs/tuning.md#grouped-int8-head).
GEMV_MAX_ROWS = 8


def pack_int8_lanes(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8, scales [N, G] -> (q [B, K, 16] int8, scales [B, G, 16]
    float32), B = ceil(N / 16): the layout of csrc/int8_gemv.cpp, byte
    (b, k, j) = q[16 b + j, k]. Rows past N are zero."""
    n, k = q.shape
    blocks = -(-n // LANES)
    pad = blocks * LANES - n
    lanes = torch.nn.functional.pad(q, (0, 0, 0, pad)).view(blocks, LANES, k).transpose(1, 2).contiguous()
    s = torch.nn.functional.pad(scales.float(), (0, 0, 0, pad)).view(blocks, LANES, -1).transpose(1, 2).contiguous()
    return lanes, s


class GroupedInt8(nn.Module):
    """x [M, K] (float32, bf16 or fp16) -> [M, N] in x's dtype: float32 x
    times the exact int8 values, or, for bf16 / fp16 x where the CPU has
    AVX512-VNNI, int8-quantized x summed in int32 (`int8x`)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = q.shape
        lanes, s = pack_int8_lanes(q, scales)
        self.q = nn.Parameter(lanes, requires_grad=False)       # [B, K, 16] int8
        self.scales = nn.Parameter(s, requires_grad=False)      # [B, G, 16] float32
        self.ops = native_ops()
        self.int8x = bool(self.ops.int8_int8x_available()) and (q.shape[1] // scales.shape[1]) % 32 == 0

    @classmethod
    def build(cls, q: torch.Tensor, scales: torch.Tensor) -> "GroupedInt8 | None":
        """None where our C++ kernels are not loaded or the groups are not runs of a multiple of 4 columns."""
        k, g = q.shape[1], scales.shape[1]
        if native_ops() is None or k % g or (k // g) % 4:
            return None
        return cls(q, scales)

    @staticmethod
    def serves(dtype: torch.dtype, device: torch.device) -> bool:
        """Whether linears in `dtype` on `device` would run the int8-activation
        kernel, which beats the dense GEMM at every row count (the float one
        only up to GEMV_MAX_ROWS: there Q8_0 linears stay dense)."""
        ops = native_ops()
        return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and ops is not None
                and bool(ops.int8_int8x_available()))

    @classmethod
    def from_matrix(cls, m: QuantizedMatrix, dtype: torch.dtype, device: torch.device) -> "GroupedInt8 | None":
        """m as int8 blocks where `serves` holds and m is symmetric 8-bit (q
        stored + 128: offsets -128 x scales) in consecutive groups of a
        multiple of 32 columns, several a row (GGUF's Q8_0, GPTQ's 8 bits);
        else None. One group a row is EETQ's, which keeps torch's kernel and
        its 16-bit activations, as TGI's EETQ does."""
        k, g = m.shape[1], m.scales.shape[1]
        if (m.bits != 8 or g == 1 or k % g or (k // g) % 32 or not cls.serves(dtype, device)
                or not torch.equal(m.group, torch.arange(k) // (k // g))
                or not torch.equal(m.offsets, -128 * m.scales)):
            return None
        return cls((m.q.to(torch.int16) - 128).to(torch.int8), m.scales)

    def beats_dense(self, x: torch.Tensor) -> bool:
        """Whether this is faster than the dense GEMM for x [M, K]."""
        return self._int8x(x) or x.shape[0] <= GEMV_MAX_ROWS

    def _int8x(self, x: torch.Tensor) -> bool:
        return self.int8x and x.dtype != torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gemv = self.ops.int8_gemv_int8x if self._int8x(x) else self.ops.int8_gemv
        return gemv(x.contiguous(), self.q, self.scales, self.out_features)
