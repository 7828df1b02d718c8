"""Our bf16 GEMM (csrc/bf16_gemm.cpp), the dense linears' kernel on CPUs with
AVX512-BF16 and no AMX: x @ w.T (+ bias) at every row count and shape, each
row independent of the others, and Linear keeping only its layout; its gated
form (bf16_mm_gated, the MLP's gate_up with the activation applied per tile)
the same bits as the GEMM followed by silu_mul / gelu_tanh_mul."""

import pytest
import torch
from torch.nn import functional as F

from tgi_kernels.native import native_ops
from tgi_server.layers.activation import gated_activation
from tgi_server.layers.linear import Linear, pack_bf16_lanes
from tgi_server.layers.mlp import FusedGateUp, GatedMLP
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


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rows_in_several_chunks_get_the_bits_they_get_alone(threads):
    """Past 128 rows at K = 1024 the GEMMs take x a chunk of rows at a time
    (kChunkBytes): every row, in the first, a middle and the last, partial
    chunk, is still computed whole, and alike."""
    w, x, bias = operands(96, 1024, 300)
    lanes, gated = pack_bf16_lanes(w), gate_up_in_turn(pack_bf16_lanes(w))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        plain, fused = ops.bf16_mm(x, lanes, 96, bias), ops.bf16_mm_gated(x, gated, 48, bias, "silu")
    finally:
        torch.set_num_threads(before)
    assert rel_err(plain, x.float() @ w.float().T + bias.float()) < 1e-2
    for i in (0, 127, 128, 200, 255, 256, 299):
        row = x[i:i + 1].contiguous()
        assert torch.equal(ops.bf16_mm(row, lanes, 96, bias)[0], plain[i])
        assert torch.equal(ops.bf16_mm_gated(row, gated, 48, bias, "silu")[0], fused[i])


def test_no_rows_give_empty_outputs():
    w, _, bias = operands(96, 64, 0)
    lanes = pack_bf16_lanes(w)
    none = torch.empty(0, 64, dtype=torch.bfloat16)
    assert ops.bf16_mm(none, lanes, 96, bias).shape == (0, 96)
    assert ops.bf16_mm_gated(none, gate_up_in_turn(lanes), 48, bias, "silu").shape == (0, 48)


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_any_thread_count_gives_every_column_once_and_the_same_bits(threads):
    """Threads take column blocks from their own share and steal the back
    half of another's (csrc/steal.h): more threads than this machine's cores
    get preempted mid-share and robbed, and the output is still one thread's."""
    w, x, bias = operands(49152 // 8, 576, 9)  # 192 pairs of blocks
    lanes, gated = pack_bf16_lanes(w), gate_up_in_turn(pack_bf16_lanes(w))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = ops.bf16_mm(x, lanes, w.shape[0], bias), ops.bf16_mm_gated(x, gated, w.shape[0] // 2, bias, "silu")
        torch.set_num_threads(threads)
        for _ in range(20):
            assert torch.equal(ops.bf16_mm(x, lanes, w.shape[0], bias), want[0])
            assert torch.equal(ops.bf16_mm_gated(x, gated, w.shape[0] // 2, bias, "silu"), want[1])
    finally:
        torch.set_num_threads(before)


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


def gate_up_in_turn(lanes: torch.Tensor) -> torch.Tensor:
    """bf16_mm's blocks of gate (first half) and up (second half) as
    bf16_mm_gated reads them: gate's first, up's first, gate's second, ..."""
    blocks = lanes.shape[0] // 2
    return lanes.view(2, blocks, *lanes.shape[1:]).transpose(0, 1).reshape(lanes.shape).contiguous()


@pytest.mark.parametrize("act, unfused", [("silu", "silu_mul"), ("gelu_tanh", "gelu_tanh_mul")])
@pytest.mark.parametrize("rows", [1, 5, 8, 17, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_gated_gemm_gives_the_bits_of_the_gemm_then_the_activation(act, unfused, rows, with_bias):
    inter = 48  # three blocks of gate, three of up
    w, x, bias = operands(2 * inter, 96, rows)
    lanes = pack_bf16_lanes(w)
    b = bias if with_bias else None
    want = getattr(ops, unfused)(ops.bf16_mm(x, lanes, 2 * inter, b))
    got = ops.bf16_mm_gated(x, gate_up_in_turn(lanes), inter, b, act)
    assert got.shape == (rows, inter) and torch.equal(got, want)
    gate, up = (x.float() @ w.float().T + (bias.float() if with_bias else 0)).chunk(2, dim=1)
    ref = (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
    assert rel_err(got, ref) < 2e-2


def test_the_gated_gemm_checks_its_operands():
    w, x, _ = operands(40, 96, 2)
    lanes = pack_bf16_lanes(w)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.bf16_mm_gated(x, lanes, 20, None, "silu")
    w, x, _ = operands(32, 96, 2)
    with pytest.raises(RuntimeError, match="act must be"):
        ops.bf16_mm_gated(x, pack_bf16_lanes(w), 16, None, "relu")


@pytest.mark.skipif(ops is not None and ops.int4_amx_available(), reason="oneDNN's AMX kernels serve AMX CPUs")
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_the_mlp_runs_gate_up_fused_with_the_same_bits_and_one_copy_of_the_weight(act):
    w, x, bias = operands(64, 96, 9)
    down_w = operands(96, 32, 1, seed=1)[0]
    mlp = GatedMLP(Linear(w, bias), Linear(down_w, None), act)
    assert isinstance(mlp.fused, FusedGateUp) and mlp.gate_up is None
    assert weight_bytes(mlp) == 64 * 96 * 2 + 64 * 4 + 96 * 32 * 2  # gate_up's blocks once, its bias in float32
    unfused = Linear(w, bias)
    with torch.inference_mode():
        assert torch.equal(mlp(x), mlp.down(gated_activation(unfused(x), act)))
        assert torch.equal(mlp(x.view(3, 3, 96)), mlp(x).view(3, 3, 96))
    # Halves that are not whole blocks keep the GEMM and the activation apart.
    assert GatedMLP(Linear(w[:40], None), Linear(down_w[:, :20], None), act).fused is None
