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

from ..distributed import TensorParallel
from ..quant import QuantizedMatrix, QuantLinear, stack_rows
from ..weights.source import TensorSource

# oneDNN repacks a plain bf16 weight into its blocked layout on every call;
# packing once at load time made SmolLM2's linears 26% (batch 1) to 40%
# (batch 64) faster on a 2-core AMX CPU. The hint is the batch it tunes for.
PACK_BATCH_HINT = 32


def _can_prepack(weight: torch.Tensor) -> bool:
    # oneDNN packs bf16 only on CPUs with AVX512-BW/VL/DQ or AVX-NE-CONVERT (it raises elsewhere).
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear(nn.Module):
    """y = x @ weight.T + bias; weight [out, in], x [T, in] -> [T, out].

    reduce: the group over which y is summed (row-parallel, world size > 1),
    None otherwise. bf16 weights on CPU are kept only in oneDNN's prepacked
    layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 reduce: TensorParallel | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.reduce = reduce
        if _can_prepack(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
            self.weight = None
        else:
            self.packed = None
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
        if self.packed is not None:
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
