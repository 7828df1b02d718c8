"""Our float32 GEMM (csrc/f32_gemm.cpp), the dense float32 linears' kernel on
CPU: x @ w.T (+ bias) at every row count and shape, each row's bits
independent of the batch it is in, and Linear keeping only its layout."""

import pytest
import torch
from torch.nn import functional as F

from tgi_kernels.native import native_ops
from tgi_server.layers.linear import Linear, pack_f32_lanes
from tgi_server.model_loader import weight_bytes

ops = native_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="our C++ kernels do not build here")
# (N, K): SmolLM2's qkv; one block; an odd number of blocks; N not a multiple of 16, K odd.
SHAPES = [(960, 576), (16, 64), (48, 96), (37, 131)]


def operands(n: int, k: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g), torch.randn(n, generator=g)


def test_the_layout_holds_each_column_where_the_kernel_reads_it():
    w = torch.arange(37 * 8, dtype=torch.float32).view(37, 8)
    lanes = pack_f32_lanes(w)
    assert lanes.shape == (3, 8, 16)
    assert lanes[1, 4, 5] == w[21, 4]  # row 21 = block 1, lane 5
    assert not lanes[2, :, 5:].any()  # rows past N


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("rows", [0, 1, 3, 6, 7, 8, 13, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_equals_the_float64_product(n, k, rows, with_bias):
    w, x, bias = operands(n, k, rows)
    y = ops.f32_mm(x, pack_f32_lanes(w), n, bias if with_bias else None)
    ref = x.double() @ w.double().T + (bias.double() if with_bias else 0)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    # float32 sums of k products: within k ulps-ish of the exact value
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-6 * k * float(ref.abs().max()) if rows else 0)


def test_a_row_gets_the_same_bits_alone_and_in_any_batch():
    w, x, bias = operands(960, 576, 70)
    lanes = pack_f32_lanes(w)
    batched = ops.f32_mm(x, lanes, 960, bias)
    for i in (0, 5, 6, 13, 69):
        assert torch.equal(ops.f32_mm(x[i:i + 1].contiguous(), lanes, 960, bias)[0], batched[i])
    assert torch.equal(ops.f32_mm(x[3:20].contiguous(), lanes, 960, bias), batched[3:20])


def test_the_kernel_checks_its_operands():
    w, x, bias = operands(48, 96, 2)
    lanes = pack_f32_lanes(w)
    with pytest.raises(RuntimeError, match="float32 tensor"):
        ops.f32_mm(x.double(), lanes, 48, None)
    with pytest.raises(RuntimeError, match="w must be"):
        ops.f32_mm(x[:, :64].contiguous(), lanes, 48, None)
    with pytest.raises(RuntimeError, match="n does not match"):
        ops.f32_mm(x, lanes, 20, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.f32_mm(x, lanes, 48, bias[:40])


def test_a_float32_linear_keeps_only_our_layout_and_equals_f_linear():
    w, x, bias = operands(40, 64, 5)
    layer = Linear(w, bias)
    assert layer.lanes is not None and layer.packed is None and layer.weight is None
    assert weight_bytes(layer) == 48 * 64 * 4 + 40 * 4  # three blocks of 16 rows, and the bias
    assert torch.equal(layer.dense_weight(), w)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, w, bias))
        # leading dimensions other than one of tokens keep their shape
        torch.testing.assert_close(layer(x.view(5, 1, 64)), F.linear(x, w, bias).view(5, 1, 40))
        torch.testing.assert_close(layer(x.t().contiguous().t()), F.linear(x, w, bias))  # a strided x
    assert Linear(w.double(), None).lanes is None  # float64 (exact comparisons) keeps F.linear
