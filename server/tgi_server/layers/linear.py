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
from .lora import column_lora, row_lora

# oneDNN repacks a plain bf16 weight into its blocked layout on every call;
# packing once at load time is faster at every batch (figures:
# docs/tuning.md#onednn-prepacked-weights). It is what serves a weight our own
# GEMMs do not (csrc/f32_gemm.cpp, csrc/bf16_gemm.cpp). The hint is the batch
# it tunes for; the choice hardly matters.
PACK_BATCH_HINT = 32


def pack_bf16_lanes(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 (K even) -> [ceil(N / 16), K / 2, 16, 2]: the layout of
    csrc/bf16_gemm.cpp, (b, p, j) = weight[16 b + j, 2 p : 2 p + 2]; rows past N are zero."""
    n, k = weight.shape
    blocks = -(-n // 16)
    padded = F.pad(weight, (0, 0, 0, blocks * 16 - n))
    return padded.view(blocks, 16, k // 2, 2).transpose(1, 2).contiguous()


def pack_f32_lanes(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 -> [ceil(N / 16), K, 16]: the layout of
    csrc/f32_gemm.cpp, (b, k, j) = weight[16 b + j, k]; rows past N are zero."""
    n, k = weight.shape
    blocks = -(-n // 16)
    return F.pad(weight, (0, 0, 0, blocks * 16 - n)).view(blocks, 16, k).transpose(1, 2).contiguous()


def _our_gemm(weight: torch.Tensor):
    """(our GEMM op, the packing it reads) where one serves this CPU weight,
    else None.
    float32 (csrc/f32_gemm.cpp), on every CPU our kernels build for: it reads
    weights packed once at load, where oneDNN's prepacked GEMM still packs x
    and MKL's sgemm packs both per call.
    bf16 (csrc/bf16_gemm.cpp) with an even number of columns, on CPUs with
    AVX512-BF16 but no AMX (where oneDNN's tile kernels win).
    Both beat oneDNN's from 1 to 512 rows (figures: docs/tuning.md#float32-gemm,
    docs/tuning.md#bf16-gemm)."""
    if weight.device.type != "cpu":
        return None
    ops = native_ops()
    if ops is None:
        return None
    if weight.dtype == torch.float32:
        return ops.f32_mm, pack_f32_lanes
    if weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and ops.bf16_mm_available() \
            and not ops.int4_amx_available():
        return ops.bf16_mm, pack_bf16_lanes
    return None


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
    None otherwise. float32 and bf16 weights on CPU are kept only in the
    layout of the GEMM that runs them: ours (`lanes`, see _our_gemm) where
    one serves the weight, oneDNN's prepacked layout (`packed`) elsewhere."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 reduce: TensorParallel | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.reduce = reduce
        self.packed = self.lanes = self.mm = None
        ours = _our_gemm(weight)
        if ours is not None:
            self.mm, pack = ours
            self.lanes = pack(weight)  # pack_f32_lanes / pack_bf16_lanes
            self.weight = None
            if bias is not None:  # the GEMM adds it in float32: widened once here, not every call
                self.bias = nn.Parameter(bias.float().contiguous(), requires_grad=False)
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
            base = cls(_cat([weights.get_slice(f"{p}.weight", 0, start, stop) for p, start, stop in parts]), b)
        else:
            loaded = [weights.linear_format.load(weights, p, 0, start, stop) for p, start, stop in parts]
            base = _build(weights, loaded, b, None)
        lora = weights.lora
        if lora is None or not any(lora.targets(p) for p, _, _ in parts):
            return base
        return column_lora(base, lora, parts, weights.dtype, weights.device)

    @classmethod
    def load_row(cls, weights: TensorSource, prefix: str, in_features: int, bias: bool,
                 tp: TensorParallel, reduce: bool = True) -> nn.Module:
        """This rank's share of the `in_features` input columns: weight
        [out, in_features / world_size]; outputs summed over the ranks (reduce
        False: left partial, for a caller that sums several layers' outputs
        first). The bias is added once, by rank 0, before the sum."""
        start, stop = tp.split(in_features)
        b = weights.get(f"{prefix}.bias") if bias and tp.rank == 0 else None
        reduce = tp if tp.world_size > 1 and reduce else None
        lora = weights.lora if weights.lora is not None and weights.lora.targets(prefix) else None
        own_reduce = None if lora is not None else reduce  # with LoRA the deltas join the partial sums first
        if weights.linear_format is None:
            base = cls(weights.get_slice(f"{prefix}.weight", 1, start, stop), b, own_reduce)
        else:
            base = _build(weights, [weights.linear_format.load(weights, prefix, 1, start, stop)], b, own_reduce)
        if lora is None:
            return base
        return row_lora(base, lora, prefix, start, stop, reduce, weights.dtype, weights.device)

    def dense_weight(self) -> torch.Tensor:
        """The weight [out, in] this layer applies, whichever layout holds it."""
        if self.lanes is not None:  # [B, K, 16] or [B, K / 2, 16, 2] -> [B, 16, K] -> [16 B, K]
            return self.lanes.transpose(1, 2).reshape(-1, self.in_features)[:self.out_features]
        return self.weight if self.packed is None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lanes is not None:
            y = self.mm(x.reshape(-1, self.in_features).contiguous(), self.lanes, self.out_features, self.bias)
            y = y.view(*x.shape[:-1], self.out_features)
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
