"""`QuantLinear`: y = x @ w.T + bias with w held quantized, in the fastest
layout this device has for it.

On CPU, chosen once at load:
- "int4": 4-bit values whose groups, after sorting the input columns by
  group (act-order), are runs of equal length. Where our C++ kernels load
  (tgi_kernels.native) and the runs are multiples of 32 columns, ours
  (csrc/int4_gemm.cpp) on their own layout (pack_int4_lanes), by rows: up to
  INT4_GEMV_MAX_ROWS a GEMV that dequantizes on the fly; past it, in bf16 with
  AMX, tiles dequantized into AMX's layout; in bf16 with AVX512-BF16 (Zen 4),
  pairs of 16-row blocks dequantized into the dense bf16 GEMM's layout, whose
  tiles then take every row of x (csrc/bf16_tile.h; the weights then equal the
  dense model's); else the weight dequantized into a per-thread scratch for
  one dense GEMM. All accumulate in float and take x in its own dtype.
  The GEMV of a bf16 or fp16 model, or of a float32 one whose kernel_dtype
  is bf16 (no --dtype float32), quantizes x to int8 per row and 32 columns
  on the way, as llama.cpp does (csrc/int4_vnni.h): integer dot products.
  Faster than the float GEMV with AVX512-VNNI and -VBMI and with AVX2, most
  where it is compute bound (8 rows and more), still ahead at one row, where
  it reads memory (figures: docs/tuning.md#int4-int8-activation-gemv). In a
  float32 model it also takes prefill, up to INT4_GEMV_MAX_ROWS["int8x"]
  rows, where it beats the dequantized GEMM. --dtype float32 keeps the float
  GEMV, exact to float32 rounding.
  Elsewhere torch's packed int4 GEMM (`_weight_int4pack_mm_for_cpu`, groups
  of 32/64/128/256, N % 16 == 0).
  It computes w = (q - 8) * scale + zero, so zero = offset + 8 * scale.
  Its bf16 path is vectorized, its fp32/fp16 paths are scalar: past
  INT4_KERNEL_MAX_ROWS input rows (prefill in bf16; any fp32/fp16 GEMM), the weight is
  unpacked from the same packed bytes into a dense matrix for one oneDNN GEMM instead.
- "grouped_int8": symmetric 8-bit values in groups of 32 columns (GGUF's
  Q8_0), bf16 or fp16 activations, AVX512-VNNI: GroupedInt8, x quantized to
  int8 per 32 columns and summed in integers at every row count.
- "int8": 8-bit values with one group per row: `_weight_int8pack_mm`
  (w = q_int8 * scale); an asymmetric row adds sum(x) * its constant.
  Also vectorized for bf16 only, and even there slower than dequantizing
  into a dense GEMM past INT8_KERNEL_MAX_ROWS rows (in fp32/fp16 at any size).
`kernel_dtype` bfloat16 with float32 activations feeds both torch kernels bf16
(x rounded to bf16, scales and output too): what the shard does in float32
unless --dtype float32 was asked for (shard.py), several times faster per GEMM.

On CUDA, "triton": 4- and 8-bit weights of any grouping (act-order too) in
our Triton kernel (tgi_kernels/triton/quant_matmul_kernel.py): dequantized
tile by tile inside the GEMM for up to 16 rows (decode), else dequantized into
a temporary for cuBLAS.

"dequant": anything else (float64 too, or CUDA without triton): the values stay
uint8 and each call dequantizes then multiplies (correct, not fast).
"""

import torch
from torch import nn
from torch.nn import functional as F

from tgi_kernels import triton as triton_kernels
from tgi_kernels.native import native_ops
from tgi_kernels.triton import pack_quantized, quant_matmul

from ..distributed import TensorParallel
from .grouped_int8 import GroupedInt8
from .quantized_matrix import QuantizedMatrix

INT4_GROUP_SIZES = (256, 128, 64, 32)
# Our int4 layout: 16 output rows a block, groups of a multiple of 32 columns.
LANES, LANE_GROUP = 16, 32
# Rows up to which our GEMV beats dequantizing into tiles / a dense GEMM, by path: the GEMV
# reads a quarter of the dense bytes, but past a few rows arithmetic, not reading, sets the
# time. "amx": bf16 with AMX, whose tiles win from a few rows. "bf16_gemm_int8x": bf16 with
# AVX512-BF16, the int8-activation GEMV (AVX512-VNNI) against blocks dequantized into the bf16
# GEMM's tiles: vpdpbusd does twice vdpbf16ps's products an instruction, so the GEMV takes
# every step up to a 4096-token prefill.
# "bf16_gemm": the same CPU without AVX512-VBMI (Cooper Lake), whose GEMV is the float one.
# "int8x": a float32 layer's int8-activation GEMV (AVX2 vpmaddubsw), which keeps up with the
# dequantized GEMM far longer than the float GEMV. By dtype, the float GEMV: float32's limit is
# high because on AVX2 the dequantized GEMM's at::mm (MKL) is slow at few rows.
# Figures: docs/tuning.md#int4-row-limits.
INT4_GEMV_MAX_ROWS = {"amx": 5, "bf16_gemm_int8x": 4096, "bf16_gemm": 48, "int8x": 1024, torch.bfloat16: 64,
                      torch.float16: 16, torch.float32: 64}
# Rows up to which torch's packed int4 kernel beats unpack + dense GEMM: its bf16 path is
# vectorized; its fp32 and fp16 paths are scalar and lose from one row
# (figures: docs/tuning.md#torch-int4-kernel-row-limits).
INT4_KERNEL_MAX_ROWS = {torch.bfloat16: 128, torch.float16: 0, torch.float32: 0}
# Rows up to which `_weight_int8pack_mm` beats dequantize + dense GEMM: vectorized for bf16
# only; in fp32 it loses from one row (figures: docs/tuning.md#torch-int8-kernel-row-limits).
INT8_KERNEL_MAX_ROWS = {torch.bfloat16: 24, torch.float16: 0, torch.float32: 0}
# Rows per block of the packed layout, by the dispatch torch picked: AVX512 64, AVX2 32 (see unpack_int4pack).
UNPACK_BLOCKS = (64, 32)
# The activations the packed kernels (torch's on CPU, ours on CUDA) take; float64 dequantizes.
PACKED_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def serves_triton(device: torch.device) -> bool:
    """Our Triton GEMM serves CUDA devices (on a CPU it would run only under Triton's interpreter)."""
    return device.type == "cuda" and triton_kernels.is_available(device)


def pack_int4_lanes(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] uint8 < 16, scales and offsets [N, G] (group g: columns [g K/G, (g+1) K/G))
    -> (packed [B, K/2, 16] uint8, scale_offset [B, G, 2, 16] in dtype), B = ceil(N / 16):
    the layout of csrc/int4_gemm.cpp. Byte (b, p, j) holds q[16b + j, 2p] in its low
    nibble and q[16b + j, 2p + 1] in its high one; (b, g, 0/1, j) is row 16b + j's
    scale / offset in group g. Rows past N are zero."""
    n, k = q.shape
    blocks = -(-n // LANES)
    pad = blocks * LANES - n
    pairs = F.pad(q, (0, 0, 0, pad)).view(blocks, LANES, k // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).transpose(1, 2).contiguous()
    so = F.pad(torch.stack([scales, offsets], -1), (0, 0, 0, 0, 0, pad))  # [B * 16, G, 2]
    return packed, so.view(blocks, LANES, -1, 2).permute(0, 2, 3, 1).to(dtype).contiguous()


def unpack_int4pack(packed: torch.Tensor, n: int, k: int, block: int,
                    dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """packed [N, K/2] uint8 from `_convert_weight_to_int4pack_for_cpu(q, 1)` -> q [N, K] in
    `dtype`. That layout holds rows in blocks (64 rows under AVX512 dispatch, 32 under
    AVX2): per block and input column, block/2 bytes whose low nibbles are the block's
    first half of rows and high nibbles the second. QuantLinear checks the round trip at
    load, so a torch with another layout only loses the dense path."""
    p = packed.view(n // block, k, block // 2)  # [N / block, K, block / 2]
    # Each half written once, converted on the way: faster than cat + transpose + cast
    # (docs/tuning.md#torch-int4-kernel-row-limits).
    q = torch.empty(n // block, 2, block // 2, k, dtype=dtype)  # [N / block, 2, block / 2, K]
    q[:, 0].copy_((p & 15).transpose(1, 2))
    q[:, 1].copy_((p >> 4).transpose(1, 2))
    return q.view(n, k)


class QuantLinear(nn.Module):
    """A quantized Linear: x [T, in] -> [T, out] in x's dtype.

    reduce: the group over which y is summed (row-parallel, world size > 1).
    kernel_dtype: the activations' dtype inside torch's CPU kernels (None: dtype;
    bfloat16 with float32 dtype trades exactness for speed, see above); our int4
    kernels take x in dtype whatever it says, but their GEMV rounds x to int8
    unless kernel_dtype is float32 (where the CPU can: int4_int8x_available).
    `kernel` names the layout chosen ("int4" | "grouped_int8" | "int8" | "triton"
    | "dequant"); an int4 layer's `native` is our kernels' op namespace, or None
    on torch's."""

    def __init__(self, matrix: QuantizedMatrix, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device, reduce: TensorParallel | None = None,
                 kernel_dtype: torch.dtype | None = None):
        super().__init__()
        self.out_features, self.in_features = matrix.shape
        self.bias = None if bias is None else _frozen(bias)
        self.reduce = reduce
        self.register_buffer("perm", None, persistent=False)  # [K] input order for act-order int4, else None
        packed = device.type == "cpu" and dtype in PACKED_KERNEL_DTYPES
        if dtype in PACKED_KERNEL_DTYPES and matrix.bits in (4, 8) and serves_triton(device):
            self._init_triton(matrix, device)
            self.kernel = "triton"
        elif packed and self._init_int4(matrix, dtype, kernel_dtype or dtype):
            self.kernel = "int4"
        elif packed and (grouped := GroupedInt8.from_matrix(matrix, dtype, device)) is not None:
            self.grouped = grouped
            self.kernel = "grouped_int8"
        elif packed and matrix.bits == 8 and matrix.scales.shape[1] == 1:
            self._init_int8(matrix, kernel_dtype or dtype)
            self.kernel = "int8"
        else:
            self.q = _frozen(matrix.q.to(device))                               # [N, K] uint8
            self.scales = _frozen(matrix.scales.to(device, dtype))              # [N, G]
            self.offsets = _frozen(matrix.offsets.to(device, dtype))            # [N, G]
            self.register_buffer("group", matrix.group.to(device), persistent=False)  # [K]
            self.kernel = "dequant"

    def _init_int4(self, m: QuantizedMatrix, dtype: torch.dtype, kernel_dtype: torch.dtype) -> bool:
        if m.bits != 4:
            return False
        order = torch.argsort(m.group, stable=True)  # [K]: input columns sorted by group
        counts = torch.bincount(m.group, minlength=m.scales.shape[1])
        run = int(counts[0])
        if not bool((counts == run).all()):
            return False
        self.native = native_ops() if run % LANE_GROUP == 0 else None
        size = next((s for s in INT4_GROUP_SIZES if run % s == 0), None)
        if self.native is None and (size is None or self.out_features % 16):
            return False
        if not torch.equal(order, torch.arange(self.in_features)):
            self.perm = order
        q = m.q[:, order]  # [N, K], groups now contiguous
        if self.native is not None:
            packed, scale_offset = pack_int4_lanes(q, m.scales, m.offsets, dtype)
            self.packed, self.scale_offset = _frozen(packed), _frozen(scale_offset)
            self.amx = dtype == torch.bfloat16 and self.native.int4_amx_available()
            self.bf16_gemm = dtype == torch.bfloat16 and not self.amx and self.native.bf16_mm_available()
            # An asked-for float32 stays exact; bf16 / fp16 activations are themselves rounded
            int8x = kernel_dtype != torch.float32 and self.native.int4_int8x_available()
            self.gemv = self.native.int4_gemv_int8x if int8x else self.native.int4_gemv
            path = ("amx" if self.amx else ("bf16_gemm_int8x" if int8x else "bf16_gemm") if self.bf16_gemm
                    else "int8x" if int8x and dtype == torch.float32 else dtype)
            self.gemv_max_rows = INT4_GEMV_MAX_ROWS[path]
            return True
        q = q.to(torch.int32)
        # Groups longer than the kernel's repeat their scale: [N, G] -> [N, K / size].
        scales = m.scales.repeat_interleave(run // size, dim=1)
        zeros = m.offsets.repeat_interleave(run // size, dim=1) + 8 * scales
        self.packed = _frozen(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))  # [N, K / 2] uint8
        scale_zeros = torch.stack([scales, zeros], -1).transpose(0, 1)  # [K/size, N, 2]
        self.scale_zeros = _frozen(scale_zeros.contiguous().to(kernel_dtype))
        self.group_size = size
        self.unpack_block = next((b for b in UNPACK_BLOCKS if self.out_features % b == 0 and torch.equal(
            unpack_int4pack(self.packed, *q.shape, b), q.to(torch.uint8))), None)
        # None: the kernel at any size
        self.int4_max_rows = None if self.unpack_block is None else INT4_KERNEL_MAX_ROWS[kernel_dtype]
        return True

    def _native_int4(self, x: torch.Tensor) -> torch.Tensor:
        """Our kernels on x [T, K] (columns in kernel order) -> [T, N] in the layer's dtype."""
        scale_offset = self.scale_offset
        if x.dtype != scale_offset.dtype or not x.is_contiguous():
            x = x.to(scale_offset.dtype).contiguous()
        if x.shape[0] <= self.gemv_max_rows:
            op = self.gemv
        elif self.amx:
            op = self.native.int4_amx_mm
        elif self.bf16_gemm:
            op = self.native.int4_bf16_mm
        else:
            op = self.native.int4_dequant_mm
        return op(x, self.packed, scale_offset, self.out_features)

    def _dense_int4(self, dtype: torch.dtype) -> torch.Tensor:
        """The int4 layout's weight [N, K] (columns in kernel order) in `dtype`."""
        n, k = self.out_features, self.in_features
        q = unpack_int4pack(self.packed, n, k, self.unpack_block, dtype)
        scale, zero = self.scale_zeros.to(dtype).permute(2, 1, 0).unsqueeze(-1)  # each [N, K/size, 1]
        # In place, in the same order of operations as (q - 8) * scale + zero.
        return q.view(n, k // self.group_size, self.group_size).sub_(8).mul_(scale).add_(zero).view(n, k)

    def _init_triton(self, m: QuantizedMatrix, device: torch.device) -> None:
        self.triton_weight = pack_quantized(m.q.to(device), m.scales.to(device), m.offsets.to(device),
                                     m.group.to(device), m.bits)
        # The same tensors as parameters, so that the shard's weight count sees them.
        self.packed = _frozen(self.triton_weight.packed)    # 4-bit: [ceil(K/2), N]; 8-bit: [K, N] uint8
        self.scales = _frozen(self.triton_weight.scales)    # [G, N] float32
        self.offsets = _frozen(self.triton_weight.offsets)  # [G, N] float32

    def _init_int8(self, m: QuantizedMatrix, dtype: torch.dtype) -> None:
        scales, offsets = m.scales[:, 0], m.offsets[:, 0]  # [N]
        self.q8 = _frozen((m.q.to(torch.int16) - 128).to(torch.int8))  # [N, K]
        self.scale8 = _frozen(scales.to(dtype))
        # w = (q - 128) * s + (offset + 128 s): the second term is one constant per row.
        constant = offsets + 128 * scales
        self.row_constant = None if bool((constant.abs() <= 1e-6 * scales).all()) else _frozen(constant.to(dtype))
        self.int8_max_rows = INT8_KERNEL_MAX_ROWS[dtype]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "triton":
            y = quant_matmul(x.reshape(-1, self.in_features), self.triton_weight).view(*x.shape[:-1], self.out_features)
        elif self.kernel == "int4":
            xs = x if self.perm is None else x.index_select(-1, self.perm)
            if self.native is not None:
                y = self._native_int4(xs)
            elif self.int4_max_rows is not None and xs.numel() > self.int4_max_rows * self.in_features:
                y = F.linear(xs, self._dense_int4(x.dtype))
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                    xs.to(self.scale_zeros.dtype).contiguous(), self.packed, self.group_size, self.scale_zeros)
        elif self.kernel == "grouped_int8":
            y = self.grouped(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        elif self.kernel == "int8" and x.numel() > self.int8_max_rows * self.in_features:
            w = self.q8.to(x.dtype) * self.scale8.to(x.dtype)[:, None]  # [N, K]
            y = F.linear(x, w if self.row_constant is None else w + self.row_constant.to(x.dtype)[:, None])
        elif self.kernel == "int8":
            xs = x.to(self.scale8.dtype)
            y = torch.ops.aten._weight_int8pack_mm(xs.contiguous(), self.q8, self.scale8)
            if self.row_constant is not None:
                y = y + xs.sum(-1, keepdim=True) * self.row_constant
        else:
            w = self.q.to(x.dtype) * self.scales[:, self.group] + self.offsets[:, self.group]  # [N, K]
            y = F.linear(x, w)
        if y.dtype != x.dtype:  # kernel_dtype differs
            y = y.to(x.dtype)
        bias = self.bias
        if bias is not None:
            y = y + bias
        return y if self.reduce is None else self.reduce.all_reduce_sum(y)


def kernel_counts(model: nn.Module) -> dict[str, int]:
    """How many quantized linears of `model` run on each kernel (what the shard logs at load)."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            counts[module.kernel] = counts.get(module.kernel, 0) + 1
    return counts
