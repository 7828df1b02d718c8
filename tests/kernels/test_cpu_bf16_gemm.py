"""Our bf16 GEMM (csrc/bf16_gemm.cpp), the dense linears' kernel on CPUs with
AVX512-BF16 and no AMX: x @ w.T (+ bias) at every row count and shape, each
row independent of the others, and Linear keeping only its layout."""

import pytest
import torch
from torch.nn import functional as F

from tgi_kernels.native import native_ops
from tgi_server.layers.linear import Linear, pack_bf16_lanes
from tgi_server.model_loader import weight_bytes

ops = native_ops()
pytestmark = pytest.mark.skipif(ops is None or not ops.bf16_mm_available(), reason="no AVX512-BF16 kernels here")
# (N, K): SmolLM2's qkv; one block; an odd number of blocks; N not a multiple of 16.
SHAPES = [(960, 576), (16, 64), (48, 96), (37, 130)]


def operands(n: int, k: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g).bfloat16(), torch.randn(rows, k, generator=g).bfloat16(), \
        torch.randn(n, generator=g).bfloat16()


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


def test_the_layout_holds_each_pair_where_the_kernel_reads_it():
    w = torch.arange(37 * 8, dtype=torch.float32).view(37, 8).bfloat16()
    lanes = pack_bf16_lanes(w)
    assert lanes.shape == (3, 4, 16, 2)
    assert torch.equal(lanes[1, 2, 5], w[21, 4:6])  # row 21 = block 1, lane 5; columns 4, 5 = pair 2
    assert not lanes[2, :, 5:].any()  # rows past N


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_equals_the_float_product_of_the_bf16_operands(n, k, rows, with_bias):
    w, x, bias = operands(n, k, rows)
    y = ops.bf16_mm(x, pack_bf16_lanes(w), n, bias if with_bias else None)
    ref = x.float() @ w.float().T + (bias.float() if with_bias else 0)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16 and rel_err(y, ref) < 1e-2


def test_a_row_gets_the_same_bits_alone_and_in_any_batch():
    w, x, _ = operands(960, 576, 70)
    lanes = pack_bf16_lanes(w)
    batched = ops.bf16_mm(x, lanes, 960, None)
    for i in (0, 8, 69):
        assert torch.equal(ops.bf16_mm(x[i:i + 1].contiguous(), lanes, 960, None)[0], batched[i])


def test_the_kernel_checks_its_operands():
    w, x, _ = operands(48, 96, 2)
    lanes = pack_bf16_lanes(w)
    with pytest.raises(RuntimeError, match="bf16 tensor"):
        ops.bf16_mm(x.float(), lanes, 48, None)
    with pytest.raises(RuntimeError, match="w must be"):
        ops.bf16_mm(x[:, :64].contiguous(), lanes, 48, None)
    with pytest.raises(RuntimeError, match="n does not match"):
        ops.bf16_mm(x, lanes, 20, None)


@pytest.mark.skipif(ops is not None and ops.int4_amx_available(), reason="oneDNN's AMX kernels serve AMX CPUs")
def test_a_bf16_linear_keeps_only_our_layout_and_equals_f_linear():
    w, x, bias = operands(40, 64, 5)
    layer = Linear(w, bias)
    assert layer.lanes is not None and layer.packed is None and layer.weight is None
    assert weight_bytes(layer) == 48 * 64 * 2 + 40 * 4  # three blocks of 16 rows, and the bias in float32
    with torch.inference_mode():
        assert rel_err(layer(x), F.linear(x.float(), w.float(), bias.float())) < 1e-2
    assert Linear(w[:, :63], None).lanes is None  # an odd number of columns has no pairs
