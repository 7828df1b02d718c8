"""float8 KV caches: every backend gives
the reference's attention over the same cache widened to the query's dtype,
and the stores write what to_cache_dtype says (scaled, saturated); keys
turned by key_rotation keep q.k and lose less of it to float8."""

import pytest
import torch

from tgi_kernels import (
    FP8_KV_DTYPES,
    available_backends,
    build_decode_meta,
    paged_decode,
    rotary_store_kv,
    store_kv,
    varlen_prefill,
)
from tgi_kernels.fp8 import key_rotation, to_cache_dtype

from .kernel_cases import make_case, make_decode_case
from .test_attention import CUDA_BACKENDS, needs_cuda

CPU = torch.device("cpu")
# triton's interpreter runs its own fp8 case below (too slow for the product)
BACKENDS = [b for b in available_backends(CPU) if b != "triton"]  # flash_attn's glue: test_flash_glue.py
FP8 = pytest.mark.parametrize("fp8", FP8_KV_DTYPES, ids=["e4m3fn", "e5m2"])
QUERY_DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def _read_cases(test):
    """Every CPU backend that reads fp8, GQA 3 / head 64 and GQA 2 / head 128,
    with and without a window, both formats, float32 and bf16 queries."""
    for mark in (pytest.mark.parametrize("backend", BACKENDS),
                 pytest.mark.parametrize("group, head_dim", [(3, 64), (2, 128)]),
                 pytest.mark.parametrize("sliding_window", [0, 6]), FP8, QUERY_DTYPES):
        test = mark(test)
    return test


def _fp8_caches(case, fp8):
    """The case's caches in fp8, and the same values widened back to the query's dtype."""
    k8, v8 = to_cache_dtype(case.k_cache, fp8), to_cache_dtype(case.v_cache, fp8)
    return (k8, v8), (k8.to(case.query.dtype), v8.to(case.query.dtype))


@_read_cases
def test_decode_reads_fp8_cache_as_its_values(backend, group, head_dim, sliding_window, fp8, dtype):
    case = make_decode_case([1, 3, 16, 17, 40], heads=2 * group, kv_heads=2, head_dim=head_dim, block_size=16,
                            dtype=dtype, seed=head_dim)
    (k8, v8), (kw, vw) = _fp8_caches(case, fp8)
    want = paged_decode(case.query, kw, vw, case.decode, 0.2, sliding_window, backend="reference")
    got = paged_decode(case.query, k8, v8, case.decode, 0.2, sliding_window, backend=backend)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@_read_cases
def test_prefill_reads_fp8_prefix_as_its_values(backend, group, head_dim, sliding_window, fp8, dtype):
    case = make_case([5, 20, 1], [3, 17, 40], heads=2 * group, kv_heads=2, head_dim=head_dim, block_size=16,
                     dtype=dtype, seed=head_dim + 1)
    (k8, v8), (kw, vw) = _fp8_caches(case, fp8)
    args = (case.query, case.key, case.value)
    want = varlen_prefill(*args, kw, vw, case.prefill, 0.2, sliding_window, backend="reference")
    got = varlen_prefill(*args, k8, v8, case.prefill, 0.2, sliding_window, backend=backend)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@FP8
def test_decode_reads_every_fp8_value_exactly(backend, head_dim, fp8):
    """Sequences of one token, whose softmax weight is exactly 1, give their
    value row back: every finite fp8 bit pattern (subnormals, both zeros,
    the largest) read as its bf16 value, by the kernels that turn fp8 rows
    into bf16 (cpu with AVX512-BF16 and VBMI) and by those that widen."""
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = patterns.view(fp8).float()
    values = torch.where(values.isfinite(), values, 0.0)   # NaN and infinity: never stored
    rows = values.reshape(-1, head_dim)                     # [256 / head_dim, head_dim]
    seqs = rows.shape[0]
    v_cache = torch.zeros(seqs, 16, 1, head_dim).to(fp8)
    v_cache[:, 0, 0] = rows.to(fp8)
    k_cache = torch.zeros_like(v_cache)
    query = torch.randn(seqs, 2, head_dim).bfloat16()
    meta = build_decode_meta([1] * seqs, [[b] for b in range(seqs)])
    out = paged_decode(query, k_cache, v_cache, meta, 0.125, backend=backend)
    assert torch.equal(out.float(), rows[:, None].expand(seqs, 2, head_dim))


def test_fp8_cache_reads_differ_from_the_float_cache():
    """The fp8 decode sees the rounded cache, not a float copy kept somewhere."""
    case = make_decode_case([40], heads=6, kv_heads=2, head_dim=64, block_size=16)
    k8, v8 = to_cache_dtype(case.k_cache, torch.float8_e5m2), to_cache_dtype(case.v_cache, torch.float8_e5m2)
    for backend in BACKENDS:
        exact = paged_decode(case.query, case.k_cache, case.v_cache, case.decode, 0.2, backend=backend)
        rounded = paged_decode(case.query, k8, v8, case.decode, 0.2, backend=backend)
        assert 1e-3 < (rounded - exact).abs().max() < 0.2, backend


@FP8
def test_to_cache_dtype_scales_and_saturates(fp8):
    top = torch.finfo(fp8).max
    x = torch.tensor([0.0, 1.0, -3.0, top * 4, -top * 4, 1e30])
    stored = to_cache_dtype(x, fp8, scale=2.0).float()
    assert stored.isfinite().all()
    assert stored.tolist() == [0.0, 0.5, -1.5, top, -top, top]


@pytest.mark.parametrize("head_dim, blocks, factor", [(64, 1, 1.0), (128, 1, 2.0), (256, 1, 1.0), (96, 3, 2.0),
                                                    (80, 5, 1.0)])
def test_key_rotation_keeps_dot_products_up_to_its_factor(head_dim, blocks, factor):
    """R R^T = factor I exactly, with entries of one power of two, the same in
    every dtype; each block of head_dim / blocks channels is mixed whole."""
    rotation, got_factor = key_rotation(head_dim, torch.float64, CPU)
    assert got_factor == factor
    assert torch.equal(rotation @ rotation.T, factor * torch.eye(head_dim, dtype=torch.float64))
    magnitude = rotation[rotation != 0].abs().unique()
    assert len(magnitude) == 1 and magnitude == 2.0 ** torch.log2(magnitude).round()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(key_rotation(head_dim, dtype, CPU)[0].double(), rotation)
    assert ((rotation != 0).sum(dim=1) == head_dim // blocks).all()


@FP8
def test_turned_keys_keep_scores_through_fp8(fp8):
    """Keys and queries with a few large channels in common (as language
    models' are after RoPE): rounded to float8 as they are, the large
    products carry the format's relative error whole; turned, each channel
    errs a little. Scores from the turned cache err several times less."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(64, 64, generator=gen), torch.randn(512, 64, generator=gen)
    q[:, [3, 40]] *= 12.0
    k[:, [3, 40]] *= 12.0
    rotation, factor = key_rotation(64, torch.float32, CPU)
    exact = q @ k.T
    plain = q @ to_cache_dtype(k, fp8).float().T
    turned = (q @ rotation) @ to_cache_dtype(k @ rotation, fp8).float().T / factor
    assert torch.allclose((q @ rotation) @ (k @ rotation).T / factor, exact, atol=1e-3)
    assert (turned - exact).abs().mean() * 3 < (plain - exact).abs().mean()


@pytest.mark.parametrize("backend", ["sdpa"] + (["triton"] if "triton" in available_backends(CPU) else []))
@FP8
def test_store_kv_writes_scaled_fp8(backend, fp8):
    """Values whose quotients by the scales are fp8 numbers, and some past the
    range: Triton's interpreter rounds float to fp8 wrongly where the
    mantissa carries (7.75 -> 4.0; a GPU rounds in hardware), so what is
    checked here is the scaling, saturation and slots, not the rounding."""
    gen = torch.Generator().manual_seed(0)
    exact = to_cache_dtype(torch.randn(2, 5, 2, 64, generator=gen) * 3, fp8).float()
    exact[:, 0, 0, :4] = torch.tensor([1e6, -1e6, 1e30, -1e30])
    key, value = exact[0] * 0.5, exact[1] * 4.0
    k_cache, v_cache = torch.zeros(4, 4, 2, 64, dtype=fp8), torch.zeros(4, 4, 2, 64, dtype=fp8)
    slots = torch.tensor([0, 5, 6, 11, 15])
    store_kv(key, value, k_cache, v_cache, slots, backend, k_scale=0.5, v_scale=4.0)
    k_flat, v_flat = k_cache.view(-1, 2, 64), v_cache.view(-1, 2, 64)
    assert torch.equal(k_flat[slots].view(torch.uint8), to_cache_dtype(key, fp8, 0.5).view(torch.uint8))
    assert torch.equal(v_flat[slots].view(torch.uint8), to_cache_dtype(value, fp8, 4.0).view(torch.uint8))


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the C++ kernels did not build here")
@FP8
@QUERY_DTYPES
def test_rotary_store_kv_writes_what_the_float_cache_holds_in_fp8(fp8, dtype):
    """The fused rotary + store into fp8 equals the fused store into a cache
    of qkv's dtype, then to_cache_dtype: the same rotation, the same rounding."""
    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, dim = 7, 6, 2, 64
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen) * 4).to(dtype)
    angle = torch.randn(tokens, 1, dim // 2, generator=gen)
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(dtype)
    sin = torch.cat([-angle.sin(), angle.sin()], -1).to(dtype)
    slots = torch.tensor([3, 0, 9, 12, 4, 1, 15])
    k_ref, v_ref = torch.zeros(4, 4, kv_heads, dim, dtype=dtype), torch.zeros(4, 4, kv_heads, dim, dtype=dtype)
    k8, v8 = torch.zeros(4, 4, kv_heads, dim, dtype=fp8), torch.zeros(4, 4, kv_heads, dim, dtype=fp8)
    rotated = qkv.clone()
    rotary_store_kv(rotated, cos, sin, heads, k_ref, v_ref, slots)
    rotary_store_kv(qkv, cos, sin, heads, k8, v8, slots, k_scale=0.25, v_scale=2.0)
    assert torch.equal(qkv, rotated)  # the query and key heads rotate as before
    assert torch.equal(k8.view(torch.uint8), to_cache_dtype(k_ref, fp8, 0.25).view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), to_cache_dtype(v_ref, fp8, 2.0).view(torch.uint8))


def _fp8_edges(fp8) -> torch.Tensor:
    """float32 values at every rounding edge of the format: each finite
    code's value, the midpoints between neighbours (ties, to even) and the
    floats on either side of them, both signs, and a little past the top."""
    codes = torch.arange(128, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    codes = codes[codes.isfinite()]
    mids = (codes[1:] + codes[:-1]) / 2
    edges = torch.cat([codes, mids, torch.nextafter(mids, torch.tensor(0.0)),
                       torch.nextafter(mids, torch.tensor(float("inf"))), codes[-1:] * 1.01])
    return torch.cat([edges, -edges])


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the C++ kernels did not build here")
@FP8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_rotary_store_kv_rounds_every_edge_as_torch(fp8, dtype):
    """The fused store's float8 rounding (vectorized for float32 and bf16
    sources) is torch's, bit for bit, at every tie and edge of the format
    and, from bf16, for every finite bf16 value (saturated past the top)."""
    values = _fp8_edges(fp8).to(dtype)
    if dtype == torch.bfloat16:
        every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        values = torch.cat([values, every[every.float().isfinite()]])
    dim = 64
    values = torch.cat([values, values[:(-len(values)) % dim]])  # whole rows of the value head
    tokens = len(values) // dim
    qkv = torch.zeros(tokens, 3, dim, dtype=dtype)
    qkv[:, 2] = values.reshape(tokens, dim)
    cos, sin = torch.ones(tokens, 1, dim, dtype=dtype), torch.zeros(tokens, 1, dim, dtype=dtype)
    k8, v8 = (torch.zeros(tokens, 1, 1, dim, dtype=fp8) for _ in range(2))
    rotary_store_kv(qkv, cos, sin, 1, k8, v8, torch.arange(tokens), v_scale=0.5)
    want = to_cache_dtype(values.reshape(tokens, 1, 1, dim), fp8, 0.5)
    assert torch.equal(v8.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the C++ kernels did not build here")
@pytest.mark.parametrize("dim", [64, 96, 128])
@QUERY_DTYPES
def test_rotary_store_kv_turns_queries_and_keys_by_key_rotation(dim, dtype):
    """With key_rotation the fused kernel's rotated query and key heads are
    then multiplied by key_rotation(dim)'s matrix (its Walsh-Hadamard
    transform, against the unfused path's matmul: the same to rounding), and
    the cache holds the turned keys; values pass as they are."""
    gen = torch.Generator().manual_seed(dim)
    tokens, heads, kv_heads = 5, 6, 2
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen) * 4).to(dtype)
    angle = torch.randn(tokens, 1, dim // 2, generator=gen)
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(dtype)
    sin = torch.cat([-angle.sin(), angle.sin()], -1).to(dtype)
    slots = torch.tensor([3, 0, 9, 12, 4])
    rotated = qkv.clone()
    rotary_store_kv(rotated, cos, sin, heads, torch.zeros(4, 4, kv_heads, dim, dtype=dtype),
                    torch.zeros(4, 4, kv_heads, dim, dtype=dtype), slots)
    want = rotated[:, :heads + kv_heads] @ key_rotation(dim, dtype, CPU)[0]
    k8, v8 = (torch.zeros(4, 4, kv_heads, dim, dtype=torch.float8_e4m3fn) for _ in range(2))
    rotary_store_kv(qkv, cos, sin, heads, k8, v8, slots, key_rotation=True)
    torch.testing.assert_close(qkv[:, :heads + kv_heads], want, **TOLERANCE[dtype])
    assert torch.equal(qkv[:, heads + kv_heads:], rotated[:, heads + kv_heads:])
    k_flat, v_flat = k8.view(-1, kv_heads, dim), v8.view(-1, kv_heads, dim)
    assert torch.equal(k_flat[slots].view(torch.uint8),
                       to_cache_dtype(qkv[:, heads:heads + kv_heads], torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(v_flat[slots].view(torch.uint8),
                       to_cache_dtype(qkv[:, heads + kv_heads:], torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.skipif("triton" not in available_backends(CPU), reason="triton is not installed")
@FP8
def test_triton_reads_fp8_cache_as_its_values(fp8):
    decode = make_decode_case([3, 17, 40], heads=6, kv_heads=2, head_dim=64, block_size=16, seed=5)
    (k8, v8), (kw, vw) = _fp8_caches(decode, fp8)
    want = paged_decode(decode.query, kw, vw, decode.decode, 0.2, 6, backend="reference")
    got = paged_decode(decode.query, k8, v8, decode.decode, 0.2, 6, backend="triton")
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])
    case = make_case([5, 20], [3, 17], heads=6, kv_heads=2, head_dim=64, block_size=16, seed=6)
    (k8, v8), (kw, vw) = _fp8_caches(case, fp8)
    args = (case.query, case.key, case.value)
    want = varlen_prefill(*args, kw, vw, case.prefill, 0.2, backend="reference")
    got = varlen_prefill(*args, k8, v8, case.prefill, 0.2, backend="triton")
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@FP8
def test_cuda_backends_read_and_store_fp8(backend, fp8):
    """On a GPU, every backend there: the Triton store rounds as torch does
    (hardware conversion), and decode and prefill read the blocks as their
    values, bf16 queries (flash_attn reads the chunk's own keys back
    rounded: a looser check)."""
    cuda = dict(dtype=torch.bfloat16, device="cuda")
    decode = make_decode_case([3, 17, 40, 300], heads=8, kv_heads=2, head_dim=128, block_size=16, seed=7, **cuda)
    (k8, v8), (kw, vw) = _fp8_caches(decode, fp8)
    want = paged_decode(decode.query, kw, vw, decode.decode, 0.1, backend="reference")
    torch.testing.assert_close(paged_decode(decode.query, k8, v8, decode.decode, 0.1, backend=backend), want,
                               **TOLERANCE[torch.bfloat16])
    case = make_case([5, 20], [3, 170], heads=8, kv_heads=2, head_dim=128, block_size=16, seed=8, **cuda)
    (k8, v8), (kw, vw) = _fp8_caches(case, fp8)
    args = (case.query, case.key, case.value)
    torch.testing.assert_close(varlen_prefill(*args, k8, v8, case.prefill, 0.1, backend=backend),
                               varlen_prefill(*args, kw, vw, case.prefill, 0.1, backend="reference"),
                               **(dict(atol=0.1, rtol=0.1) if backend == "flash_attn" else TOLERANCE[torch.bfloat16]))
    key = torch.randn(9, 2, 128, device="cuda") * 5
    k_cache, v_cache = torch.zeros(4, 4, 2, 128, dtype=fp8, device="cuda"), torch.zeros(4, 4, 2, 128, dtype=fp8,
                                                                                       device="cuda")
    slots = torch.arange(9, device="cuda") + 3
    store_kv(key, key, k_cache, v_cache, slots, backend, k_scale=0.5, v_scale=2.0)
    assert torch.equal(k_cache.view(-1, 2, 128)[slots].view(torch.uint8),
                       to_cache_dtype(key, fp8, 0.5).view(torch.uint8))
