"""Linear layers, whole or split over the ranks of a tensor-parallel group;
dense, or swapped for a QuantLinear when the checkpoint's linears are
quantized (TensorSource.linear_format), with the same slicing.

Column-parallel: a rank holds some output rows of the weight, and its output
stays split (the next layer consumes the rank's part). A merged layer
concatenates rows of several checkpoint matrices so one GEMM serves them all
(q/k/v, gate/up); each rank takes its own rows of each part.
Row-parallel: a rank holds the input columns matching its share of the
previous column-parallel output; the partial outputs are summed over the
ranks. At world size 1 both are the whole matrix and nothing is summed."""

import torch
from torch import nn
from torch.nn import functional as F

from tgi_kernels.native import native_ops

from ..distributed import TensorParallel
from ..quant import QuantizedMatrix, QuantLinear, stack_rows
from ..weights.source import TensorSource

# oneDNN repacks a plain bf16 weight into its blocked layout on every call;
# packing once at load time made SmolLM2's linears 26% (batch 1) to 40%
# (batch 64) faster on a 2-core AMX CPU. float32 weights went through MKL's
# sgemm (F.linear), which at few rows reads the weight at 2-5 GB/s on a 2-core
# Zen 1 (AVX2): oneDNN's prepacked float32 GEMM took SmolLM2's whole decode
# step from 300 / 442 / 714 ms to 84 / 191 / 329 ms at batch 8 / 32 / 64, and a
# 512-token prefill from 3.1 to 1.76 s. The hint is the batch it tunes for
# (None, 8, 32 and 128 measured within noise of each other there).
PACK_BATCH_HINT = 32


def pack_bf16_lanes(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 (K even) -> [ceil(N / 16), K / 2, 16, 2]: the layout of
    csrc/bf16_gemm.cpp, (b, p, j) = weight[16 b + j, 2 p : 2 p + 2]; rows past N are zero."""
    n, k = weight.shape
    blocks = -(-n // 16)
    padded = F.pad(weight, (0, 0, 0, blocks * 16 - n))
    return padded.view(blocks, 16, k // 2, 2).transpose(1, 2).contiguous()


def _bf16_gemm(weight: torch.Tensor):
    """Our C++ ops where their bf16 GEMM serves this weight: a bf16 weight with
    an even number of columns on a CPU with AVX512-BF16 but no AMX (where
    oneDNN's tile kernels win); else None."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.shape[1] % 2:
        return None
    ops = native_ops()
    return ops if ops is not None and ops.bf16_mm_available() and not ops.int4_amx_available() else None


def _can_prepack(weight: torch.Tensor) -> bool:
    # oneDNN packs float32 on any x86 CPU, bf16 only on CPUs with AVX512-BW/VL/DQ or
    # AVX-NE-CONVERT (it raises elsewhere).
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Linear(nn.Module):
    """y = x @ weight.T + bias; weight [out, in], x [T, in] -> [T, out].

    reduce: the group over which y is summed (row-parallel, world size > 1),
    None otherwise. bf16 and float32 weights on CPU are kept only in the
    layout of the GEMM that runs them: ours (csrc/bf16_gemm.cpp, `lanes`) for
    bf16 on AVX512-BF16 CPUs without AMX, 1.1-2x oneDNN's there at 1 to 512
    rows; oneDNN's prepacked layout (`packed`) elsewhere."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 reduce: TensorParallel | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.reduce = reduce
        self.packed = self.lanes = None
        self.ops = _bf16_gemm(weight)
        if self.ops is not None:
            self.lanes = pack_bf16_lanes(weight)  # [ceil(out / 16), in / 2, 16, 2]
            self.weight = None
            if bias is not None:  # the GEMM adds it in float32: widened once here, not every call
                self.bias = nn.Parameter(bias.float(), requires_grad=False)
        elif _can_prepack(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
            self.weight = None
        else:
            self.weight = nn.Parameter(weight, requires_grad=False)

    @classmethod
    def load_column(cls, weights: TensorSource, parts: list[tuple[str, int, int]], bias: bool) -> nn.Module:
        """Rows [start, stop) of each (prefix, start, stop) part's `prefix.weight`
        (and `prefix.bias`), concatenated in order: weight [sum(stop - start), in].
        A quantized checkpoint (weights.linear_format) gives a QuantLinear."""
        b = _cat([weights.get_slice(f"{p}.bias", 0, start, stop) for p, start, stop in parts]) if bias else None
        if weights.linear_format is None:
            return cls(_cat([weights.get_slice(f"{p}.weight", 0, start, stop) for p, start, stop in parts]), b)
        loaded = [weights.linear_format.load(weights, p, 0, start, stop) for p, start, stop in parts]
        return _build(weights, loaded, b, None)

    @classmethod
    def load_row(cls, weights: TensorSource, prefix: str, in_features: int, bias: bool,
                 tp: TensorParallel) -> nn.Module:
        """This rank's share of the `in_features` input columns: weight
        [out, in_features / world_size]; outputs summed over the ranks. The
        bias is added once, by rank 0, before the sum."""
        start, stop = tp.split(in_features)
        b = weights.get(f"{prefix}.bias") if bias and tp.rank == 0 else None
        reduce = tp if tp.world_size > 1 else None
        if weights.linear_format is None:
            return cls(weights.get_slice(f"{prefix}.weight", 1, start, stop), b, reduce)
        return _build(weights, [weights.linear_format.load(weights, prefix, 1, start, stop)], b, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lanes is not None:
            y = self.ops.bf16_mm(x.contiguous(), self.lanes, self.out_features, self.bias)
        elif self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if self.reduce is None else self.reduce.all_reduce_sum(y)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def _build(weights: TensorSource, parts: list[QuantizedMatrix | torch.Tensor], bias: torch.Tensor | None,
           reduce: TensorParallel | None) -> nn.Module:
    """One layer from row blocks that a LinearFormat loaded: a QuantLinear
    when all are quantized; a dense Linear when some block type has no
    quantized kernel (those quantized are then dequantized with it)."""
    if all(isinstance(p, QuantizedMatrix) for p in parts):
        return QuantLinear(stack_rows(parts), bias, weights.dtype, weights.device, reduce,
                           weights.quant_kernel_dtype)
    dense = [p.dequantize(weights.dtype).to(weights.device) if isinstance(p, QuantizedMatrix) else p for p in parts]
    return Linear(_cat(dense), bias, reduce)
