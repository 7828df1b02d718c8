"""QuantLinear and the checkpoint encodings: every kernel computes what the
dequantized weight computes, and each format's packing reads back exactly."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from tgi_server.quant import QuantizedMatrix, QuantLinear, quant_linear, quantize_rtn
from tgi_server.quant.gguf_linear import decode_q4
from tgi_server.quant.packing import awq_pack, awq_unpack, pack, unpack
from tgi_server.quant.quant_linear import INT4_KERNEL_MAX_ROWS, INT8_KERNEL_MAX_ROWS
from tgi_server.quant.quantizer.export import awq_tensors, gptq_tensors
from tgi_server.quant.quantizer.gptq_solver import gptq_quantize

from ..triton_interpreter import use_triton_interpreter

CPU = torch.device("cpu")


def random_weight(n: int = 48, k: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def run(matrix: QuantizedMatrix, dtype=torch.float32, t: int = 5,
        bias=None) -> tuple[QuantLinear, torch.Tensor, torch.Tensor]:
    """(layer, its output, the dequantized reference) on random x [t, K]."""
    layer = QuantLinear(matrix, bias, dtype, CPU)
    x = torch.randn(t, matrix.shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    reference = x.float() @ matrix.dequantize().T + (0 if bias is None else bias.float())
    with torch.inference_mode():
        return layer, layer(x).float(), reference


def act_order_matrix(w: torch.Tensor, group_size: int) -> QuantizedMatrix:
    """4-bit groups of `group_size` with the columns shuffled: an unsorted g_idx, as act-order
    checkpoints of other quantizers hold (ours fixes groups on consecutive columns)."""
    m = quantize_rtn(w, 4, group_size, symmetric=False)
    perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(4))
    return QuantizedMatrix(m.q[:, perm].contiguous(), m.scales, m.offsets, m.group[perm], 4)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture
def torch_int4(monkeypatch):
    """int4 layers on torch's packed kernel, as where our C++ kernels do not load."""
    monkeypatch.setattr(quant_linear, "native_ops", lambda: None)


@pytest.fixture(params=["ours", "torch"])
def int4_kernels(request, monkeypatch):
    """Each int4 implementation in turn: our C++ kernels (skipped where they do not
    build) and torch's packed kernel."""
    if request.param == "torch":
        monkeypatch.setattr(quant_linear, "native_ops", lambda: None)
    elif quant_linear.native_ops() is None:
        pytest.skip("our C++ kernels do not build here")
    return request.param


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_int4_kernel_matches_the_dequantized_weight(group_size, int4_kernels):
    layer, y, ref = run(quantize_rtn(random_weight(), 4, group_size, symmetric=False))
    assert layer.kernel == "int4" and (layer.native is not None) == (int4_kernels == "ours")
    assert rel_err(y, ref) < 1e-5


def test_int4_kernel_in_bfloat16_stays_within_bfloat16_rounding(int4_kernels):
    layer, y, ref = run(quantize_rtn(random_weight(), 4, 32, symmetric=True), torch.bfloat16, t=32)
    assert layer.kernel == "int4" and rel_err(y, ref) < 2e-2


def test_act_order_groups_run_on_int4_with_the_input_permuted(int4_kernels):
    m = act_order_matrix(random_weight(), 32)
    assert not torch.equal(m.group, torch.sort(m.group).values)  # really unsorted
    layer, y, ref = run(m)
    assert layer.kernel == "int4" and layer.perm is not None and rel_err(y, ref) < 1e-5


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("act_order", [False, True])
def test_int4_prefill_rows_unpack_to_one_dense_gemm_equal_to_the_kernel(dtype, tolerance, act_order, torch_int4):
    # 128 output rows: two blocks of the packed layout. Past INT4_KERNEL_MAX_ROWS[dtype] rows the
    # layer unpacks the same bytes into a dense weight; under it, the int4 kernel runs.
    w = random_weight(128, 256)
    m = act_order_matrix(w, 64) if act_order else quantize_rtn(w, 4, 64, symmetric=False)
    rows = INT4_KERNEL_MAX_ROWS[dtype] + 3
    layer, y, ref = run(m, dtype, t=rows)
    assert layer.kernel == "int4" and layer.int4_max_rows == INT4_KERNEL_MAX_ROWS[dtype]
    assert rel_err(y, ref) < tolerance
    kernel_only = QuantLinear(m, None, dtype, CPU)
    kernel_only.int4_max_rows = None
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        assert rel_err(kernel_only(x).float(), y) < tolerance


# Run in a fresh process: ATEN_CPU_CAPABILITY is read once, at the first dispatch.
UNPACK_CHECK = """
import torch
from tgi_server.quant import QuantLinear, quant_linear, quantize_rtn
from tgi_server.quant.quant_linear import unpack_int4pack
quant_linear.native_ops = lambda: None  # torch's int4 kernel, whose layout this checks
q = torch.randint(0, 16, (192, 96), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
layer = QuantLinear(quantize_rtn(torch.randn(192, 128), 4, 32, symmetric=False), None, torch.float32,
                    torch.device("cpu"))
x = torch.randn(9, 128)
with torch.inference_mode():
    dense = layer(x)
    layer.int4_max_rows = None
    kernel = layer(x)
print(torch.backends.cpu.get_cpu_capability(), layer.unpack_block,
      torch.equal(unpack_int4pack(packed, 192, 96, layer.unpack_block), q.to(torch.uint8)),
      float((dense - kernel).abs().max() / kernel.abs().max()))
"""


# The dispatches this process may force: ATEN_CPU_CAPABILITY above what the
# CPU (or this process's own ATEN_CPU_CAPABILITY) allows dies with SIGILL.
DISPATCHES = {"AVX512": ("avx512", "avx2"), "AVX2": ("avx2",)}.get(torch.backends.cpu.get_cpu_capability(), ())


@pytest.mark.parametrize("capability", [
    pytest.param(c, marks=pytest.mark.skipif(
        c not in DISPATCHES, reason=f"torch dispatches at most {torch.backends.cpu.get_cpu_capability()} here, "
                                    f"below {c}: forcing {c} would die with SIGILL"))
    for c in ("avx512", "avx2")])
def test_int4_layout_unpacks_to_the_values_packed_under_each_dispatch(capability):
    """torch packs rows in blocks of 64 under AVX512 dispatch and of 32 under
    AVX2: the layer finds which, and its dense path computes what the kernel does."""
    out = subprocess.run([sys.executable, "-c", UNPACK_CHECK], env={**os.environ, "ATEN_CPU_CAPABILITY": capability},
                         capture_output=True, text=True, check=True).stdout.split()
    got, block, round_trip, err = out[0], int(out[1]), out[2], float(out[3])
    assert got.lower() == capability
    assert block == {"avx512": 64, "avx2": 32}[capability] and round_trip == "True" and err < 1e-5


def test_int4_rows_not_in_blocks_of_64_keep_the_kernel_at_every_size(torch_int4):
    layer, y, ref = run(quantize_rtn(random_weight(48), 4, 32, symmetric=False), t=40)
    assert layer.kernel == "int4" and layer.int4_max_rows is None and rel_err(y, ref) < 1e-5


@pytest.mark.parametrize("bits, group_size, rows", [(4, 32, 1), (4, 32, 5), (4, 32, 200), (8, -1, 1), (8, -1, 5)])
def test_float32_activations_run_the_kernels_in_bfloat16_when_asked(bits, group_size, rows, torch_int4):
    """kernel_dtype bf16 (the shard's default for a float32 model): x enters
    torch's packed kernel as bf16 and the output comes back as float32; past
    INT4_KERNEL_MAX_ROWS[bf16] rows the dense GEMM runs in float32."""
    m = quantize_rtn(random_weight(128, 256), bits, group_size, symmetric=False)
    layer = QuantLinear(m, None, torch.float32, CPU, kernel_dtype=torch.bfloat16)
    assert layer.kernel == ("int4" if bits == 4 else "int8")
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        y = layer(x)
    assert y.dtype == torch.float32
    # The reference sees what the kernel sees: x and the weight's scales rounded to bf16.
    assert rel_err(y, x.bfloat16().float() @ m.dequantize().T) < 2e-2
    assert (layer.scale_zeros if bits == 4 else layer.scale8).dtype == torch.bfloat16


# (dtype, rows, tolerance): bf16 up to INT8_KERNEL_MAX_ROWS rows runs `_weight_int8pack_mm`;
# more rows, and fp32 at any size, dequantize the same int8 values into one dense GEMM.
INT8_CASES = [(torch.float32, 5, 1e-5), (torch.bfloat16, 5, 2e-2),
              (torch.bfloat16, INT8_KERNEL_MAX_ROWS[torch.bfloat16] + 3, 2e-2)]


@pytest.mark.parametrize("dtype, rows, tolerance", INT8_CASES)
def test_symmetric_int8_per_row_runs_on_the_int8_layout(dtype, rows, tolerance):
    layer, y, ref = run(quantize_rtn(random_weight(), 8, -1, symmetric=True), dtype, t=rows)
    assert layer.kernel == "int8" and layer.row_constant is None and rel_err(y, ref) < tolerance


@pytest.mark.parametrize("dtype, rows, tolerance", INT8_CASES)
def test_asymmetric_int8_per_row_adds_the_row_constant(dtype, rows, tolerance):
    layer, y, ref = run(quantize_rtn(random_weight() + 0.5, 8, -1, symmetric=False), dtype, t=rows)
    assert layer.kernel == "int8" and layer.row_constant is not None and rel_err(y, ref) < tolerance


@pytest.mark.parametrize("bits, group_size, n", [(8, 32, 48), (4, 32, 40)], ids=["int8-groups", "n-not-16x"])
def test_layouts_without_a_kernel_dequantize_per_call(bits, group_size, n, torch_int4):
    layer, y, ref = run(quantize_rtn(random_weight(n), bits, group_size, symmetric=True), bias=torch.ones(n))
    assert layer.kernel == "dequant" and rel_err(y, ref) < 1e-5


@pytest.mark.parametrize("bits", [4, 8])
def test_float64_dequantizes_per_call_as_the_packed_kernels_take_no_float64(bits):
    layer, y, ref = run(quantize_rtn(random_weight(), bits, -1, symmetric=bits == 8), dtype=torch.float64)
    assert layer.kernel == "dequant"
    assert rel_err(y, ref) < 1e-6


def test_rtn_error_is_within_half_a_step():
    w = random_weight()
    m = quantize_rtn(w, 4, 32, symmetric=False)
    step = m.scales[:, m.group]
    assert bool(((m.dequantize() - w).abs() <= step / 2 + 1e-6).all())


@pytest.mark.parametrize("bits, dim", [(4, 0), (4, 1), (8, 0), (8, 1)])
def test_gptq_packing_round_trips(bits, dim):
    values = torch.randint(0, 2 ** bits, (16, 32))
    assert torch.equal(unpack(pack(values, bits, dim), bits, dim), values.to(torch.uint8))


def test_awq_packing_uses_the_interleaved_order():
    assert int(awq_pack(torch.arange(8)[None])) == 0x75316420  # slot i holds column (0,2,4,6,1,3,5,7)[i]
    values = torch.randint(0, 16, (4, 64))
    assert torch.equal(awq_unpack(awq_pack(values)), values.to(torch.uint8))


def test_gptq_export_stores_zeros_minus_one():
    m = quantize_rtn(random_weight(), 4, 32, symmetric=True)
    tensors = gptq_tensors("p", m)
    assert set(unpack(tensors["p.qzeros"], 4, 1).flatten().tolist()) == {7}
    assert tensors["p.qweight"].shape == (16, 48) and tensors["p.scales"].shape == (4, 48)


def test_awq_export_shapes():
    tensors = awq_tensors("p", quantize_rtn(random_weight(), 4, 32, symmetric=False))
    assert tensors["p.qweight"].shape == (128, 6) and tensors["p.qzeros"].shape == (4, 6)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_gguf_q4_blocks_decode_to_what_gguf_dequantizes(qtype):
    w = random_weight(16, 64).numpy().astype(np.float32)
    blocks = quantize(w, qtype)  # [16, bytes per row]
    expected = dequantize(blocks, qtype).reshape(16, 64)
    assert np.allclose(decode_q4(blocks, qtype).dequantize().numpy(), expected, atol=1e-6)


def test_gptq_beats_round_to_nearest_on_correlated_inputs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(512, 128, generator=g) @ torch.randn(128, 128, generator=g) * 0.3  # [T, K]
    w = random_weight()
    h = x.T @ x / len(x)

    def output_error(m):
        return float(((x @ m.dequantize().T) - x @ w.T).pow(2).mean())
    assert output_error(gptq_quantize(w, h, 4, 32, act_order=False)) < output_error(quantize_rtn(w, 4, 32, True))


@pytest.mark.parametrize("bits, group_size, act_order", [(4, 32, False), (4, 32, True), (8, -1, False)])
def test_the_triton_layout_runs_under_the_interpreter_as_on_cuda(monkeypatch, bits, group_size, act_order):
    # The CUDA wiring (pack at load, kernel per call, rows past the fused kernel's 16
    # through the dequantize path) on this CPU under Triton's interpreter.
    if not use_triton_interpreter():
        pytest.skip("needs triton")
    monkeypatch.setattr(quant_linear, "serves_triton", lambda device: True)
    w = random_weight(48, 128)
    m = act_order_matrix(w, 32) if act_order else quantize_rtn(w, bits, group_size, symmetric=False)
    for t in (3, 20):
        layer, y, ref = run(m, t=t, bias=torch.randn(48))
        assert layer.kernel == "triton" and rel_err(y, ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("bits, group_size", [(4, 32), (8, -1)])
@pytest.mark.parametrize("rows", [7, 300])
def test_cuda_layers_run_the_triton_kernel_and_match_the_reference(bits, group_size, rows):
    matrix = quantize_rtn(random_weight(), bits, group_size, symmetric=False)
    layer = QuantLinear(matrix, None, torch.bfloat16, torch.device("cuda"))
    x = torch.randn(rows, 128, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        y = layer(x).float().cpu()
    assert layer.kernel == "triton" and rel_err(y, x.float().cpu() @ matrix.dequantize().T) < 2e-2


@pytest.mark.gpu
def test_cuda_float64_dequantizes_per_call():
    matrix = quantize_rtn(random_weight(), 4, 32, symmetric=False)
    layer = QuantLinear(matrix, None, torch.float64, torch.device("cuda"))
    x = torch.randn(5, 128, device="cuda", dtype=torch.float64)
    with torch.inference_mode():
        y = layer(x).cpu()
    assert layer.kernel == "dequant" and rel_err(y, x.cpu() @ matrix.dequantize(torch.float64).T) < 1e-6
