"""Our int4 CPU kernels (csrc/int4_gemm.cpp): each computes x @ w.T for the
dequantized w at every row count, shape and dtype, and QuantLinear serves
4-bit layers on them without keeping torch's layout too."""

import pytest
import torch

from tgi_kernels.native import native_ops
from tgi_server.layers.linear import pack_bf16_lanes
from tgi_server.quant import QuantizedMatrix, QuantLinear, quantize_rtn
from tgi_server.quant.quant_linear import INT4_GEMV_MAX_ROWS, pack_int4_lanes

ops = native_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the C++ CPU kernels did not build here")
CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative max error against the float32 product of the same (dtype-rounded) weights: float32
# accumulates exactly to rounding; bf16 / fp16 also round the output, and the GEMMs the weights.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# (N, K, group): SmolLM2's qkv; N not a multiple of 16 (a partial block); an odd number of
# blocks (the AMX kernel pairs them); one group a row; groups of 64 and 128.
SHAPES = [(960, 576, 32), (40, 256, 64), (37, 96, 32), (130, 192, -1), (48, 1536, 128)]


def matrix(n: int, k: int, group: int, seed: int = 0) -> QuantizedMatrix:
    return quantize_rtn(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), 4, group, symmetric=False)


def operands(m: QuantizedMatrix, dtype: torch.dtype, rows: int):
    """(x, packed, scale_offset, reference): reference = x @ w.T in float32, w from the
    scales and offsets as the layout holds them (rounded to dtype)."""
    packed, scale_offset = pack_int4_lanes(m.q, m.scales, m.offsets, dtype)
    w = m.q.float() * m.scales.to(dtype).float()[:, m.group] + m.offsets.to(dtype).float()[:, m.group]
    x = torch.randn(rows, m.shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
    return x, packed, scale_offset, x.float() @ w.T


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


def test_the_layout_holds_each_value_where_the_kernels_read_it():
    m = matrix(37, 96, 32)
    packed, so = pack_int4_lanes(m.q, m.scales, m.offsets, torch.float32)
    assert packed.shape == (3, 48, 16) and so.shape == (3, 3, 2, 16)
    n, p = 16 + 5, 7  # row 21 = block 1, lane 5; columns 14 and 15 = pair 7
    assert packed[1, p, 5] == m.q[n, 2 * p] | (m.q[n, 2 * p + 1] << 4)
    assert so[1, 2, 0, 5] == m.scales[n, 2] and so[1, 2, 1, 5] == m.offsets[n, 2]
    assert not packed[2, :, 5:].any() and not so[2, :, :, 5:].any()  # rows past N


@pytest.mark.parametrize("n, k, group", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17])
def test_gemv_equals_the_dequantized_product(n, k, group, dtype, rows):
    x, packed, so, ref = operands(matrix(n, k, group), dtype, rows)
    y = ops.int4_gemv(x, packed, so, n)
    assert y.shape == (rows, n) and y.dtype == dtype and rel_err(y, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("n, k, group", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 33, 130])
def test_dequantized_gemm_equals_the_dequantized_product(n, k, group, dtype, rows):
    x, packed, so, ref = operands(matrix(n, k, group), dtype, rows)
    y = ops.int4_dequant_mm(x, packed, so, n)
    assert y.shape == (rows, n) and y.dtype == dtype and rel_err(y, ref) < TOLERANCE[dtype]


needs_int8x = pytest.mark.skipif(ops is None or not ops.int4_int8x_available(), reason="no AVX2 or AVX512-VNNI here")
# x rounded to int8 per 32 columns moves each product by up to 1/254 of its run's largest |x| times
# |w|: the error is measured against the size of the terms, sum |x| |w|, as well as the output's
# rounding; against |y| it can be larger where the terms cancel (a large offset, one group a row).
INT8X_TOLERANCE = 1e-2


def int8x_err(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    return float((y.float() - x.float() @ w.T).abs().max() / (x.float().abs() @ w.abs().T).max())


@needs_int8x
@pytest.mark.parametrize("n, k, group", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17])
def test_gemv_with_int8_activations_stays_near_the_dequantized_product(n, k, group, dtype, rows):
    m = matrix(n, k, group)
    x, packed, so, _ = operands(m, dtype, rows)
    y = ops.int4_gemv_int8x(x, packed, so, n)
    w = m.q.float() * m.scales.to(dtype).float()[:, m.group] + m.offsets.to(dtype).float()[:, m.group]
    assert y.shape == (rows, n) and y.dtype == dtype and int8x_err(y, x, w) < INT8X_TOLERANCE


@needs_int8x
def test_int8_activations_are_exact_where_x_is_a_multiple_of_its_scale():
    """Each run of 32 columns of x holds integers up to 127 in magnitude, 127 among
    them: quantizing loses nothing, so only the output's rounding is left."""
    m = matrix(64, 128, 32)
    packed, so = pack_int4_lanes(m.q, m.scales, m.offsets, torch.float16)
    x = torch.randint(-127, 128, (3, 128), generator=torch.Generator().manual_seed(9)).float()
    x[:, ::32] = 127
    w = m.q.float() * m.scales.half().float()[:, m.group] + m.offsets.half().float()[:, m.group]
    y = ops.int4_gemv_int8x(x.half(), packed, so, 64)
    assert rel_err(y, x @ w.T) < TOLERANCE[torch.float16]


@needs_int8x
def test_int8_activations_give_each_row_the_same_result_at_every_row_count():
    """A row's output does not depend on the rows beside it (its products sum
    exactly in int32, then in float in one order): a prompt's K/V is the same
    whether it is prefilled whole or after a prefix cache hit, and a
    sequence's logits the same alone, in a batch or with drafts."""
    m = matrix(64, 1536, 64)
    x, packed, so, _ = operands(m, torch.bfloat16, 70)
    together = ops.int4_gemv_int8x(x, packed, so, 64)
    for r in (0, 7, 8, 69):
        assert torch.equal(ops.int4_gemv_int8x(x[r:r + 1].contiguous(), packed, so, 64)[0], together[r])
    assert torch.equal(ops.int4_gemv_int8x(x[:9].contiguous(), packed, so, 64), together[:9])


@needs_int8x
def test_quant_linear_takes_int8_activations_unless_float32_was_asked_for():
    """bf16 activations, or float32 ones whose kernel dtype is bf16 (the shard's
    default for a float32 model), go to int8; float32 asked for stays exact."""
    m = matrix(48, 128, 32)
    assert QuantLinear(m, None, torch.bfloat16, CPU).gemv == ops.int4_gemv_int8x
    assert QuantLinear(m, None, torch.float32, CPU, kernel_dtype=torch.bfloat16).gemv == ops.int4_gemv_int8x
    assert QuantLinear(m, None, torch.float32, CPU).gemv == ops.int4_gemv


needs_amx = pytest.mark.skipif(ops is None or not ops.int4_amx_available(), reason="no AMX-BF16 here")


@needs_amx
@pytest.mark.parametrize("n, k, group", SHAPES)
@pytest.mark.parametrize("rows", [1, 16, 17, 32, 33, 100])
def test_amx_equals_the_dequantized_product(n, k, group, rows):
    x, packed, so, ref = operands(matrix(n, k, group), torch.bfloat16, rows)
    y = ops.int4_amx_mm(x, packed, so, n)
    assert y.shape == (rows, n) and rel_err(y, ref) < TOLERANCE[torch.bfloat16]
    # The same bf16 weights and float accumulation as the dense GEMM: equal up to the output's rounding.
    assert rel_err(y, ops.int4_dequant_mm(x, packed, so, n).float()) < 1e-2


needs_bf16_gemm = pytest.mark.skipif(ops is None or not ops.bf16_mm_available(), reason="no AVX512-BF16 here")


@needs_bf16_gemm
@pytest.mark.parametrize("n, k, group", SHAPES)
@pytest.mark.parametrize("rows", [1, 8, 9, 33, 100])
def test_bf16_tiles_over_dequantized_blocks_equal_the_dequantized_product(n, k, group, rows):
    x, packed, so, ref = operands(matrix(n, k, group), torch.bfloat16, rows)
    y = ops.int4_bf16_mm(x, packed, so, n)
    assert y.shape == (rows, n) and rel_err(y, ref) < TOLERANCE[torch.bfloat16]
    # The same bf16 weights and float accumulation as the dense GEMM: equal up to the output's rounding.
    assert rel_err(y, ops.int4_dequant_mm(x, packed, so, n).float()) < 1e-2


@needs_bf16_gemm
def test_the_bf16_tiles_see_the_weights_the_dense_model_holds():
    """Dequantized and rounded to bf16 once, as the GGUF file dequantized to a bf16
    checkpoint holds them: against that dense weight on the bf16 GEMM, the same bits."""
    m = matrix(48, 256, 64)
    packed, so = pack_int4_lanes(m.q, m.scales, m.offsets, torch.bfloat16)
    # q * scale + offset rounded once to float32, as the kernel's fused multiply-add does (exact in float64)
    scales, offsets = m.scales.bfloat16().double(), m.offsets.bfloat16().double()
    dense = (m.q.double() * scales[:, m.group] + offsets[:, m.group]).float()
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    expected = ops.bf16_mm(x, pack_bf16_lanes(dense.bfloat16()), 48, None)
    assert torch.equal(ops.int4_bf16_mm(x, packed, so, 48), expected)


def test_the_kernels_check_their_operands():
    x, packed, so, _ = operands(matrix(48, 128, 32), torch.float32, 2)
    with pytest.raises(RuntimeError, match="x's dtype"):
        ops.int4_gemv(x.bfloat16(), packed, so, 48)
    with pytest.raises(RuntimeError, match="n does not match"):
        ops.int4_gemv(x, packed, so, 20)
    with pytest.raises(RuntimeError, match="packed must be"):
        ops.int4_dequant_mm(x[:, :64].contiguous(), packed, so, 48)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act_order", [False, True])
def test_quant_linear_serves_every_row_count_on_our_kernels(dtype, act_order):
    """Below, at and past the GEMV's row limit, with the input columns permuted
    (act-order) or not: the layer equals the dequantized reference."""
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(3))
    m = quantize_rtn(w, 4, 64, symmetric=False)
    if act_order:
        perm = torch.randperm(256, generator=torch.Generator().manual_seed(4))
        m = QuantizedMatrix(m.q[:, perm].contiguous(), m.scales, m.offsets, m.group[perm], 4)
    layer = QuantLinear(m, torch.ones(40, dtype=dtype), dtype, CPU)
    assert layer.kernel == "int4" and layer.native is not None and (layer.perm is not None) == act_order
    w = m.q.float() * m.scales.to(dtype).float()[:, m.group] + m.offsets.to(dtype).float()[:, m.group]
    for rows in (1, layer.gemv_max_rows, layer.gemv_max_rows + 1, 70):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
        with torch.inference_mode():
            y = layer(x)
        assert y.dtype == dtype
        if layer.gemv == ops.int4_gemv_int8x and rows <= layer.gemv_max_rows:
            assert int8x_err(y - 1, x, w) < INT8X_TOLERANCE
        else:
            assert rel_err(y, x.float() @ w.T + 1) < TOLERANCE[dtype]


def test_quant_linear_keeps_only_our_layout():
    """No second copy: the nibbles (K / 2 bytes a row) and one scale and offset a
    group, nothing of torch's packed layout."""
    layer = QuantLinear(matrix(960, 576, 32), None, torch.bfloat16, CPU)
    held = {name: t.numel() * t.element_size() for name, t in layer.named_parameters()}
    assert held == {"packed": 960 * 576 // 2, "scale_offset": 960 * 18 * 2 * 2}
    assert not hasattr(layer, "scale_zeros")


def test_float32_keeps_its_scales_and_rounds_only_the_gemv_activations_when_kernel_dtype_says_bf16():
    """Our kernels take x and the scales in float32 whatever kernel_dtype says; with
    kernel_dtype bf16 (the shard's default for a float32 model) the GEMV rounds x to
    int8 per 32 columns where it can, and past its rows the layer is exact again; a
    float32 asked for (kernel_dtype None) is exact at every row count."""
    m = matrix(48, 128, 32)
    fast = QuantLinear(m, None, torch.float32, CPU, kernel_dtype=torch.bfloat16)
    exact = QuantLinear(m, None, torch.float32, CPU)
    assert fast.scale_offset.dtype == exact.scale_offset.dtype == torch.float32
    w = m.dequantize()
    for rows in (1, fast.gemv_max_rows + 1):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(5))
        with torch.inference_mode():
            assert rel_err(exact(x), x @ w.T) < 1e-5
            if rows > fast.gemv_max_rows or not ops.int4_int8x_available():
                assert rel_err(fast(x), x @ w.T) < 1e-5
            else:
                assert int8x_err(fast(x), x, w) < INT8X_TOLERANCE


def test_groups_that_are_not_runs_of_32_keep_the_torch_paths():
    layer = QuantLinear(matrix(48, 128, 16), None, torch.float32, CPU)
    assert layer.kernel == "dequant"


def test_gemv_limits_cover_each_path():
    assert set(INT4_GEMV_MAX_ROWS) == {"amx", "bf16_gemm_int8x", "bf16_gemm", "int8x", *DTYPES}
