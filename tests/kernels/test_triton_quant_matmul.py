"""The Triton weight-only quantized GEMM against QuantizedMatrix.dequantize()
followed by F.linear: both of quant_matmul's paths, the fused kernel and
dequantize + torch.mm.

CPU: Triton's interpreter, float32, small shapes: 4- and 8-bit, row counts
that fill a tile or not, N not a multiple of the tile, groups of 32/64/128, a
single group, act-order (shuffled) groups, split-K, every tile config.
`@pytest.mark.gpu`: the compiled kernels in fp16/bf16 at SmolLM2 / 1.1B-Llama
shapes, act-order, split-K and CUDA-graph replay. A slow test compiles the
kernels to PTX for sm_90 without a GPU, for errors only the compiler reports.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from tgi_server.quant.quantized_matrix import QuantizedMatrix, quantize_rtn

from ..triton_interpreter import use_triton_interpreter

pytestmark = pytest.mark.skipif(not use_triton_interpreter(), reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[2]
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def _kernel():
    from tgi_kernels.triton import quant_matmul_kernel

    return quant_matmul_kernel


def make_matrix(n: int, k: int, bits: int, group_size: int, act_order: bool = False,
                seed: int = 0) -> QuantizedMatrix:
    """Random q [N, K] with GPTQ-like scales and offsets (offset = -zero * scale);
    group_size -1: one group per row; act_order: the columns' groups shuffled."""
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if group_size == -1 else -(-k // group_size)
    group = torch.zeros(k, dtype=torch.int64) if group_size == -1 else torch.arange(k) // group_size
    if act_order:
        group = group[torch.randperm(k, generator=gen)]
    q = torch.randint(0, 2 ** bits, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=gen) + 0.5) * (0.04 / 2 ** (bits - 4))
    zeros = torch.randint(0, 2 ** bits, (n, groups), generator=gen).float()
    return QuantizedMatrix(q, scales, -zeros * scales, group, bits)


def pack(matrix: QuantizedMatrix, device=DEVICE):
    m = matrix
    return _kernel().pack_quantized(m.q.to(device), m.scales.to(device), m.offsets.to(device), m.group.to(device),
                                    m.bits)


def reference(x: torch.Tensor, matrix: QuantizedMatrix, weight_dtype=torch.float64) -> torch.Tensor:
    """float64 x @ w.T, w dequantized in float32 then rounded to weight_dtype."""
    w = matrix.dequantize(torch.float32).to(weight_dtype).to(x.device, torch.float64)
    return F.linear(x.double(), w)


def assert_close_fp32(y: torch.Tensor, want: torch.Tensor) -> None:
    assert y.dtype == F32 and y.shape == want.shape
    scale = want.abs().max().item()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * scale)


# --- interpreter (CPU) / any device: float32 ------------------------------------------

# (M, N, K, group_size, act_order): M around the 16-row tile and past it (a
# medium tile), N not a multiple of the 64-column tile, K with several groups,
# shorter than a K tile, not a multiple of it, and odd (4-bit padding).
CASES = {
    "m1-g32": (1, 48, 256, 32, False),
    "m5-g64": (5, 80, 256, 64, False),
    "m33-g128": (33, 48, 384, 128, False),
    "m1-one-group": (1, 80, 256, -1, False),
    "m5-one-group-k200": (5, 80, 200, -1, False),
    "m33-g32-k96": (33, 80, 96, 32, False),
    "m5-k99-odd": (5, 48, 99, -1, False),
    "m1-act-order-g32": (1, 48, 256, 32, True),
    "m5-act-order-g64": (5, 80, 256, 64, True),
    "m33-act-order-g128": (33, 80, 384, 128, True),
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "dequant"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_dequantize_then_linear(name, bits, fused):
    m, n, k, group_size, act_order = CASES[name]
    matrix = make_matrix(n, k, bits, group_size, act_order, seed=m + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    y = _kernel().quant_matmul(x, pack(matrix), fused=fused)
    assert_close_fp32(y, reference(x, matrix))


def test_default_path_follows_rows(monkeypatch):
    qk = _kernel()
    matrix = make_matrix(48, 64, 4, 32)
    packed = pack(matrix)
    calls = []
    real = qk.dequantize_transposed
    monkeypatch.setattr(qk, "dequantize_transposed", lambda *a: calls.append(1) or real(*a))
    for m in (1, qk.FUSED_MAX_M, qk.FUSED_MAX_M + 1):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m)).to(DEVICE)
        assert_close_fp32(qk.quant_matmul(x, packed), reference(x, matrix))
    assert len(calls) == 1  # only the M = FUSED_MAX_M + 1 call dequantized
    qk.quant_matmul(torch.randn(40, 64, device=DEVICE), packed, split_k=1)  # an option of the fused kernel: fused
    assert len(calls) == 1


@pytest.mark.parametrize("bits, group_size, act_order", [(4, 32, True), (8, -1, False), (4, 64, False)],
                         ids=["4bit-act-order", "8bit-per-row", "4bit-g64"])
def test_dequantize_transposed(bits, group_size, act_order):
    matrix = make_matrix(130, 99, bits, group_size, act_order, seed=10)  # both sizes off the 128/32 tile
    w = _kernel().dequantize_transposed(pack(matrix), F32)
    assert w.shape == (99, 130) and w.dtype == F32
    torch.testing.assert_close(w.cpu(), matrix.dequantize().t(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("config", ["DECODE", "MEDIUM", "LARGE"])
@pytest.mark.parametrize("bits, act_order", [(4, False), (8, True)], ids=["4bit", "8bit-act-order"])
def test_every_tile_config_matches(config, bits, act_order):
    qk = _kernel()
    matrix = make_matrix(80, 320, bits, 64, act_order, seed=3)
    x = torch.randn(70, 320, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    y = qk.quant_matmul(x, pack(matrix), config=getattr(qk, config))  # a config: the fused kernel
    assert_close_fp32(y, reference(x, matrix))


@pytest.mark.parametrize("splits", [2, 3, 16])
@pytest.mark.parametrize("bits, group_size, act_order", [(4, 128, False), (4, 32, True), (8, -1, False)],
                         ids=["4bit-g128", "4bit-act-order", "8bit-per-row"])
def test_split_k_matches(splits, bits, group_size, act_order):
    matrix = make_matrix(48, 640, bits, group_size, act_order, seed=4)
    x = torch.randn(5, 640, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    y = _kernel().quant_matmul(x, pack(matrix), split_k=splits)
    assert_close_fp32(y, reference(x, matrix))


def test_quantize_rtn_weights_round_trip():
    weight = torch.randn(80, 256, generator=torch.Generator().manual_seed(6)) * 0.05
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    for bits, group_size, symmetric in ((4, 64, False), (4, -1, True), (8, -1, True), (8, 128, False)):
        matrix = quantize_rtn(weight, bits, group_size, symmetric)
        assert_close_fp32(_kernel().quant_matmul(x, pack(matrix)), reference(x, matrix))


def test_strided_and_non_contiguous_activations():
    matrix = make_matrix(48, 128, 4, 32, seed=8)
    packed = pack(matrix)
    wide = torch.randn(7, 300, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    rows = wide[:, 100:228]  # stride(0) = 300, last dim contiguous: used as is
    columns = wide[:, :128].t().contiguous().t()  # column-major: copied
    for x in (rows, columns):
        for fused in (True, False):
            assert_close_fp32(_kernel().quant_matmul(x, packed, fused=fused), reference(x, matrix))


def test_empty_batch_and_shape_errors():
    qk = _kernel()
    packed = pack(make_matrix(48, 64, 8, -1))
    for fused in (True, False):
        assert qk.quant_matmul(torch.empty(0, 64, device=DEVICE), packed, fused=fused).shape == (0, 48)
    with pytest.raises(ValueError):
        qk.quant_matmul(torch.zeros(2, 63, device=DEVICE), packed)
    with pytest.raises(ValueError):
        qk.quant_matmul(torch.zeros(2, 64, device=DEVICE, dtype=torch.float64), packed)
    m = make_matrix(48, 64, 8, -1)
    with pytest.raises(ValueError):
        qk.pack_quantized(m.q, m.scales, m.offsets, m.group, 3)


def test_pack_layout_and_group_size():
    qk = _kernel()
    m = make_matrix(3, 5, 4, -1)
    p = qk.pack_quantized(m.q, m.scales, m.offsets, m.group, 4)
    assert p.packed.shape == (3, 3) and p.packed.dtype == torch.uint8  # [ceil(K/2), N]
    for k in range(5):
        nibble = (p.packed[k // 2] >> (4 * (k % 2))) & 0xF
        assert torch.equal(nibble, m.q[:, k])
    assert torch.equal(p.packed[2] >> 4, torch.zeros(3, dtype=torch.uint8))  # the padding column
    assert p.scales.shape == (1, 3) and p.scales.dtype == F32 and p.group.dtype == torch.int32
    assert (p.in_features, p.out_features, p.bits) == (5, 3, 4)
    moved = p.to(DEVICE)
    assert moved.packed.device.type == DEVICE and moved.group_size == p.group_size
    p8 = qk.pack_quantized(m.q, m.scales, m.offsets, m.group, 8)
    assert torch.equal(p8.packed, m.q.t())
    # group_size: runs of equal length (the last may be shorter), else 0.
    sizes = {}
    for name, (group_size, act_order) in {"g32": (32, False), "one": (-1, False), "act": (32, True)}.items():
        m = make_matrix(4, 128, 4, group_size, act_order)
        sizes[name] = qk.pack_quantized(m.q, m.scales, m.offsets, m.group, 4).group_size
    uneven = torch.tensor([0] * 24 + [1] * 40)  # the first group shorter
    m = make_matrix(4, 64, 4, 32)
    sizes["uneven"] = qk.pack_quantized(m.q, m.scales, m.offsets, uneven, 4).group_size
    assert sizes == {"g32": 32, "one": 128, "act": 0, "uneven": 0}


def test_tile_config_follows_rows_and_short_groups():
    qk = _kernel()
    assert qk.tile_config(1) == qk.tile_config(16) == qk.DECODE
    assert qk.tile_config(17) == qk.tile_config(64) == qk.MEDIUM
    assert qk.tile_config(65) == qk.tile_config(4096) == qk.LARGE
    assert qk.tile_config(1, 32).block_k == 32 and qk.tile_config(1, 64).block_k == 64
    assert qk.tile_config(1, 128).block_k == 128 and qk.tile_config(1, 0).block_k == 128
    assert qk.tile_config(1000, 32).block_k == 32 and qk.tile_config(1000, 256).block_k == 64


# --- compiler only (no GPU needed) -----------------------------------------------------

_COMPILE = """
from tests.kernels.compile_for_cuda import compile_sources
from triton.compiler import ASTSource
from tgi_kernels.triton import quant_matmul_kernel as qk

cases = [(d, b, a, c, s) for d in ("bf16",) for b in (4, 8) for a in (True, False)
         for c, s in (("DECODE", True), ("DECODE", False), ("MEDIUM", False), ("LARGE", False))]
cases += [("fp16", 4, True, "DECODE", True), ("fp16", 4, True, "LARGE", False),
          ("fp32", 8, False, "DECODE", True), ("fp32", 4, True, "MEDIUM", False)]
jobs = []
for dtype, bits, aligned, name, split in cases:
    cfg = getattr(qk, name)
    signature = dict(x=f"*{dtype}", packed="*u8", scales="*fp32", offsets="*fp32", group="*i32",
                     out="*fp32" if split else f"*{dtype}", M="i32", N="i32", K="i32", k_per_split="i32",
                     stride_xm="i32", group_size="i32")
    constexprs = dict(BITS=bits, ALIGNED=aligned, SPLIT=split, PRECISION="ieee" if dtype == "fp32" else "tf32",
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    signature.update({k: "constexpr" for k in constexprs})
    jobs.append((f"{dtype} {bits}-bit aligned={aligned} {name} split={split}",
                 ASTSource(fn=qk._quant_matmul_kernel, signature=signature, constexprs=constexprs),
                 dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)))
for dtype, bits in (("bf16", 4), ("bf16", 8), ("fp16", 4), ("fp32", 8)):
    constexprs = dict(BITS=bits, BLOCK_K=qk.DEQUANT_BLOCK_K, BLOCK_N=qk.DEQUANT_BLOCK_N)
    signature = dict(packed="*u8", scales="*fp32", offsets="*fp32", group="*i32", out=f"*{dtype}", N="i32", K="i32",
                     **{k: "constexpr" for k in constexprs})
    jobs.append((f"dequant {dtype} {bits}-bit", ASTSource(fn=qk._dequant_kernel, signature=signature,
                                                         constexprs=constexprs), {}))
for line in compile_sources(jobs):
    print(line)
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_kernel_compiles_to_ptx_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path))  # a real compile, not a cache hit
    done = subprocess.run([sys.executable, "-c", _COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = done.stdout.splitlines()
    assert len(compiled) == 24 and all(line.startswith("compiled ") for line in compiled)


# --- GPU: fp16/bf16 at model shapes -----------------------------------------------------

# One unit in the last place, relative, and at the output's largest magnitude: room for
# the output's rounding and for cuBLAS's reduced-precision split-K sums (the dequantize
# path's torch.mm, as torch allows by default for fp16/bf16).
GPU_TOLERANCE = {F16: 2 ** -10, BF16: 2 ** -7}
# Relative error (Frobenius) against the unrounded float32 weight: the weight's and
# the output's rounding to the dtype.
GPU_LOOSE = {F16: 2e-3, BF16: 1.5e-2}
# (N, K, bits, group_size): SmolLM2's MLP up (4-bit, groups of 64), a 1.1B Llama's
# gate/up (4-bit, groups of 128) and its down projection (8-bit, one scale per row).
GPU_SHAPES = {
    "smollm2-up-4bit-g64": (1536, 576, 4, 64),
    "llama1b-up-4bit-g128": (5632, 2048, 4, 128),
    "llama1b-down-8bit-per-row": (2048, 5632, 8, -1),
}


def assert_close_gpu(y: torch.Tensor, x: torch.Tensor, matrix: QuantizedMatrix) -> None:
    assert y.dtype == x.dtype and torch.isfinite(y).all()
    want = reference(x, matrix, weight_dtype=x.dtype)  # the weight rounded as the kernel rounds it
    scale = want.abs().max().item()
    ulp = GPU_TOLERANCE[x.dtype]
    torch.testing.assert_close(y.double(), want, rtol=ulp, atol=ulp * scale)
    exact = reference(x, matrix)
    assert ((y.double() - exact).norm() / exact.norm()).item() < GPU_LOOSE[x.dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 128, 1000])
@pytest.mark.parametrize("name", list(GPU_SHAPES))
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_gpu_matches_reference(dtype, name, m):
    n, k, bits, group_size = GPU_SHAPES[name]
    matrix = make_matrix(n, k, bits, group_size, seed=k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to("cuda", dtype)
    assert_close_gpu(_kernel().quant_matmul(x, pack(matrix, "cuda")), x, matrix)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [48, 300])
def test_gpu_fused_kernel_forced_on_many_rows(m):
    # MEDIUM (48 rows) and LARGE (300) tiles: not the default path there, but correct.
    qk = _kernel()
    matrix = make_matrix(1536, 2048, 4, 128, seed=17)
    x = torch.randn(m, 2048, generator=torch.Generator().manual_seed(m)).to("cuda", BF16)
    assert_close_gpu(qk.quant_matmul(x, pack(matrix, "cuda"), fused=True), x, matrix)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 48, 300])
def test_gpu_act_order(m):
    matrix = make_matrix(1536, 2048, 4, 128, act_order=True, seed=11)
    x = torch.randn(m, 2048, generator=torch.Generator().manual_seed(m)).to("cuda", BF16)
    assert_close_gpu(_kernel().quant_matmul(x, pack(matrix, "cuda")), x, matrix)


@pytest.mark.gpu
def test_gpu_split_k_and_vocab_sized_output():
    # SmolLM2's lm_head shape (N 49152, K 576): many tiles, so the default does not split;
    # then forced splits give the same result.
    qk = _kernel()
    matrix = make_matrix(49152, 576, 8, -1, seed=12)
    packed = pack(matrix, "cuda")
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(13)).to("cuda", BF16)
    assert qk.default_split_k(3, 49152, 576, qk.DECODE, x.device) == 1
    for splits in (None, 1, 3):
        assert_close_gpu(qk.quant_matmul(x, packed, split_k=splits), x, matrix)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    # Decode runs under CUDA graphs: the split-K workspace is allocated inside the capture.
    # N 256: a 1.1B Llama's k/v projection, few output tiles, so split-K by default.
    qk = _kernel()
    matrix = make_matrix(256, 2048, 4, 128, seed=14)
    packed = pack(matrix, "cuda")
    x = torch.zeros(4, 2048, device="cuda", dtype=BF16)
    assert qk.default_split_k(4, 256, 2048, qk.DECODE, x.device) > 1
    qk.quant_matmul(x, packed)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        qk.quant_matmul(x, packed)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = qk.quant_matmul(x, packed)
    for seed in (15, 16):
        x.copy_(torch.randn(4, 2048, generator=torch.Generator().manual_seed(seed)).to("cuda", BF16))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_gpu(y, x, matrix)
