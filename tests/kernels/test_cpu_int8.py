"""Our int8 GEMVs (csrc/int8_gemv.cpp, quant/grouped_int8.py): x @ w.T for
w = scale * q with one scale per row and group of columns (GGUF's Q8_0),
at every row count, shape and dtype; and the one that quantizes x to int8
(AVX512-VNNI)."""

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
    lanes, s = pack_int8_lanes(q, scales)
    y = ops.int8_gemv(x, lanes, s, n)
    assert y.shape == (rows, n) and y.dtype == dtype and rel_err(y, ref) < TOLERANCE[dtype]


needs_int8x = pytest.mark.skipif(ops is None or not ops.int8_int8x_available(), reason="no AVX512-VNNI here")
# x rounded to int8 per 32 columns moves each product by up to 1/254 of its run's largest |x|
# times |w|: measured against the size of the terms, sum |x| |w| (tests/kernels/test_cpu_int4.py).
INT8X_TOLERANCE = 1e-2


@needs_int8x
@pytest.mark.parametrize("n, k, group", [shape for shape in SHAPES if shape[2] % 32 == 0])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17, 64])
def test_gemv_with_int8_activations_stays_near_the_dequantized_product(n, k, group, dtype, rows):
    q, scales, x, ref = operands(n, k, group, rows, dtype)
    lanes, s = pack_int8_lanes(q, scales)
    y = ops.int8_gemv_int8x(x, lanes, s, n)
    w = q.float() * scales.repeat_interleave(group, dim=1)
    err = float((y.float() - ref).abs().max() / (x.float().abs() @ w.abs().T).max())
    assert y.shape == (rows, n) and y.dtype == dtype and err < INT8X_TOLERANCE


@needs_int8x
def test_int8_activations_are_exact_where_x_is_a_multiple_of_its_scale():
    """Integers up to 127 with 127 in every run of 32 columns quantize to
    themselves, and weights of -128 and 127 reach both ends of the unsigned
    shift: only the output's rounding is left."""
    q, scales, _, _ = operands(40, 128, 32, 1, torch.float32, seed=3)
    q[:, :8], q[:, 8:16] = -128, 127
    x = torch.randint(-127, 128, (5, 128), generator=torch.Generator().manual_seed(4)).float()
    x[:, ::32] = 127
    lanes, s = pack_int8_lanes(q, scales)
    y = ops.int8_gemv_int8x(x.half(), lanes, s, 40)
    assert rel_err(y, x @ (q.float() * scales.repeat_interleave(32, dim=1)).T) < TOLERANCE[torch.float16]


@needs_int8x
def test_each_row_comes_out_the_same_at_every_row_count():
    """A row's result does not depend on the rows beside it: a sequence's
    logits are the same whether it decodes alone, in a batch or with drafts."""
    q, scales, x, _ = operands(64, 576, 32, 19, torch.bfloat16)
    lanes, s = pack_int8_lanes(q, scales)
    together = ops.int8_gemv_int8x(x, lanes, s, 64)
    for r in (0, 7, 8, 18):
        assert torch.equal(ops.int8_gemv_int8x(x[r:r + 1].contiguous(), lanes, s, 64)[0], together[r])


@needs_int8x
def test_the_head_takes_int8_activations_for_bf16_at_every_row_count_and_float32_exactly():
    q, scales, x, _ = operands(48, 64, 32, 40, torch.float32)
    head = GroupedInt8.build(q, scales)
    assert head.beats_dense(x.bfloat16()) and head.beats_dense(x[:8]) and not head.beats_dense(x)
    assert torch.equal(head(x.bfloat16()), ops.int8_gemv_int8x(x.bfloat16(), head.q, head.scales, 48))
    assert torch.equal(head(x[:8]), ops.int8_gemv(x[:8], head.q, head.scales, 48))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        q4, s4, x4, _ = operands(16, 64, 16, 1, torch.bfloat16)
        ops.int8_gemv_int8x(x4, *pack_int8_lanes(q4, s4), 16)


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
