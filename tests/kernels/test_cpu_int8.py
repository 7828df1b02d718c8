"""Our int8 GEMV (csrc/int8_gemv.cpp, quant/grouped_int8.py): x @ w.T for
w = scale * q with one scale per row and group of columns (GGUF's Q8_0),
at every row count, shape and dtype."""

import pytest
import torch

from tgi_kernels.native import native_ops
from tgi_server.quant.grouped_int8 import GroupedInt8, pack_int8_lanes

ops = native_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the C++ CPU kernels did not build here")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative max error against the float32 product of the exact weights: float32 accumulates
# exactly to rounding; bf16 / fp16 round the input and output.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# (N, K, group): SmolLM2's head width; N not a multiple of 16 (a partial block); groups of 4 and 64.
SHAPES = [(64, 576, 32), (37, 96, 32), (20, 16, 4), (48, 256, 64)]


def operands(n: int, k: int, group: int, rows: int, dtype: torch.dtype, seed: int = 0):
    """(q [N, K] int8, scales [N, K / group], x [rows, K] in dtype, reference x @ w.T in float32)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) * 0.02
    x = torch.randn(rows, k, generator=g).to(dtype)
    return q, scales, x, x.float() @ (q.float() * scales.repeat_interleave(group, dim=1)).T


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


def test_the_layout_holds_each_value_where_the_kernel_reads_it():
    q, scales, _, _ = operands(37, 96, 32, 1, torch.float32)
    lanes, s = pack_int8_lanes(q, scales)
    assert lanes.shape == (3, 96, 16) and lanes.dtype == torch.int8 and s.shape == (3, 3, 16)
    assert lanes[1, 14, 5] == q[21, 14] and s[1, 2, 5] == scales[21, 2]  # row 21 = block 1, lane 5
    assert not lanes[2, :, 5:].any() and not s[2, :, 5:].any()  # rows past N


@pytest.mark.parametrize("n, k, group", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17])
def test_gemv_equals_the_dequantized_product(n, k, group, dtype, rows):
    q, scales, x, ref = operands(n, k, group, rows, dtype)
    y = GroupedInt8.build(q, scales)(x)
    assert y.shape == (rows, n) and y.dtype == dtype and rel_err(y, ref) < TOLERANCE[dtype]


def test_groups_that_are_not_runs_of_four_columns_get_no_gemv():
    q, scales, _, _ = operands(16, 12, 6, 1, torch.float32)
    assert GroupedInt8.build(q, scales) is None


def test_mismatched_operands_are_refused():
    q, scales, x, _ = operands(32, 64, 32, 2, torch.float32)
    lanes, s = pack_int8_lanes(q, scales)
    with pytest.raises(RuntimeError, match="float32"):
        ops.int8_gemv(x, lanes, s.double(), 32)
    with pytest.raises(RuntimeError, match="int8"):
        ops.int8_gemv(x[:, :32].contiguous(), lanes, s, 32)
    with pytest.raises(RuntimeError, match="n does not match"):
        ops.int8_gemv(x, lanes, s, 40)
