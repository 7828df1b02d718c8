"""Our C++ CPU kernels (tgi_kernels.native) against plain torch: they build
wherever a compiler is, and every op agrees with the torch path it replaces."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from tgi_kernels import available_backends, paged_decode, rotary_store_kv, store_kv
from tgi_kernels.native import native_ops

from .kernel_cases import make_decode_case, naive_attention

DTYPES = [torch.float32, torch.bfloat16, torch.float64]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float64: dict(atol=1e-12, rtol=1e-12)}
ops = native_ops()
needs_ops = pytest.mark.skipif(ops is None, reason="the C++ CPU kernels did not build here")


def test_the_kernels_build_wherever_a_compiler_is():
    # A machine with g++ must get them: a silent fallback would hide a broken build.
    if shutil.which("g++") or shutil.which("c++"):
        assert ops is not None and "cpu" in available_backends(torch.device("cpu"))


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rms_norm_matches_torch(dtype, rows):
    x = torch.randn(rows, 576, dtype=dtype) * 3
    w = torch.randn(576, dtype=dtype)
    want = F.rms_norm(x.double(), (576,), w.double(), 1e-5).to(dtype)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), want, **TOL[dtype])


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_adds_in_place_then_normalises(dtype):
    x, residual = torch.randn(7, 64, dtype=dtype), torch.randn(7, 64, dtype=dtype)
    w = torch.randn(64, dtype=dtype)
    total = residual + x  # rounded to dtype, as the eager `residual + x`
    out = ops.add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(residual, total)
    torch.testing.assert_close(out, F.rms_norm(total.double(), (64,), w.double(), 1e-6).to(dtype), **TOL[dtype])


@needs_ops
def test_norm_reads_strided_rows():
    x = torch.randn(4, 128)[:, :64]  # row stride 128
    w = torch.randn(64)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (64,), w, 1e-5))


def _rotate(x, cos, sin):
    """Hugging Face's rotate-half in float64: x [T, h, D], cos/sin [T, 1, D] (sin signed)."""
    return x.double() * cos.double() + x.double().roll(x.shape[-1] // 2, dims=-1) * sin.double()


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_store_kv_rotates_q_and_k_and_stores_k_and_v(dtype):
    tokens, heads, kv_heads, dim, block_size = 5, 6, 2, 16, 4
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, dtype=dtype)
    angles = torch.rand(tokens, 1, dim // 2) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    k_cache = torch.zeros(4, block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 9, 0, 14, 5])
    want_qk = _rotate(qkv[:, :heads + kv_heads], cos, sin).to(dtype)
    want_v = qkv[:, heads + kv_heads:].clone()
    want_k_cache, want_v_cache = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    store_kv(want_qk[:, heads:], want_v, want_k_cache, want_v_cache, slots)

    rotary_store_kv(qkv, cos, sin, heads, k_cache, v_cache, slots)
    torch.testing.assert_close(qkv[:, :heads + kv_heads], want_qk, **TOL[dtype])
    assert torch.equal(qkv[:, heads + kv_heads:], want_v)
    torch.testing.assert_close(k_cache, want_k_cache, **TOL[dtype])
    assert torch.equal(v_cache, want_v_cache)


@needs_ops
def test_rotary_store_kv_rejects_a_slot_outside_the_cache():
    qkv = torch.randn(1, 3, 8)
    cos = sin = torch.ones(1, 1, 8)
    cache = torch.zeros(1, 2, 1, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        rotary_store_kv(qkv, cos, sin, 1, cache, cache.clone(), torch.tensor([2]))


@needs_ops
@pytest.mark.parametrize("sliding_window", [0, 5])
def test_decode_reads_only_the_context_in_place(sliding_window):
    # No gather: slots outside a sequence's context may hold anything, even NaN.
    case = make_decode_case([1, 7, 19, 40], heads=6, kv_heads=2, head_dim=32, block_size=8, seed=7)
    used = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool)  # [num_blocks, block_size]
    for table, n in zip(case.decode.block_tables.tolist(), case.decode.seq_lens.tolist()):
        for p in range(n):
            used[table[p // 8], p % 8] = True
    k_cache = case.k_cache.masked_fill(~used[:, :, None, None], float("nan"))
    v_cache = case.v_cache.masked_fill(~used[:, :, None, None], float("nan"))
    out = paged_decode(case.query, k_cache, v_cache, case.decode, 0.2, sliding_window, backend="cpu")
    for b, (k, v) in enumerate(zip(case.contexts_k, case.contexts_v)):
        want = naive_attention(case.query[b:b + 1], k, v, [k.shape[0] - 1], 0.2, sliding_window)
        torch.testing.assert_close(out[b:b + 1].double(), want, atol=1e-5, rtol=1e-5)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [
    (9, 3, 64),     # SmolLM2: all three kv heads in one work item
    (32, 4, 64),    # G = 8: two kv heads an item
    (16, 1, 128),   # G = 16, the most the kernel takes
    (18, 6, 96),    # a head dim the vector path takes without unrolling; 3 kv heads an item
    (4, 2, 80),     # not a multiple of 16: the plain path (with AVX-512)
])
@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_in_chunks_across_heads_and_blocks_matches_the_reference(dtype, heads, kv_heads, head_dim, block_size):
    # Lengths inside, at and across block and 16-token chunk boundaries, and long enough to prefetch.
    case = make_decode_case([1, 15, 16, 17, 64, 150], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                            block_size=block_size, dtype=dtype, seed=heads + head_dim)
    want = paged_decode(case.query, case.k_cache, case.v_cache, case.decode, head_dim ** -0.5, backend="reference")
    for window in (0, 21):
        got = paged_decode(case.query, case.k_cache, case.v_cache, case.decode, head_dim ** -0.5, window,
                           backend="cpu")
        ref = (want if not window else
               paged_decode(case.query, case.k_cache, case.v_cache, case.decode, head_dim ** -0.5, window,
                            backend="reference"))
        torch.testing.assert_close(got.float(), ref.float(), **(TOL[torch.float32] if dtype == torch.float32
                                                                  else TOL[torch.bfloat16]))


@needs_ops
def test_decode_takes_the_query_as_a_strided_view_of_qkv():
    case = make_decode_case([3, 17], heads=4, kv_heads=2, head_dim=16, block_size=4, seed=2)
    qkv = torch.cat([case.query, torch.randn(2, 4, 16)], dim=1)  # [B, H + 2 KVH, D]
    strided = qkv[:, :4]
    want = paged_decode(case.query, case.k_cache, case.v_cache, case.decode, 0.25, backend="reference")
    got = paged_decode(strided, case.k_cache, case.v_cache, case.decode, 0.25, backend="cpu")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    gate_up = torch.randn(3, 2 * 40, dtype=dtype) * 4
    gate, up = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), (F.silu(gate) * up).to(dtype), **TOL[dtype])


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_matches_torch(dtype):
    """Both saturations of tanh (|gate| up to ~40) and the values near 0."""
    gate_up = torch.randn(3, 2 * 40, dtype=dtype) * 10
    gate_up[0, :8] = torch.tensor([0.0, 1e-4, -1e-4, 1e-2, -1e-2, 0.5, -0.5, 1.0])
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = (F.gelu(gate, approximate="tanh") * up).to(dtype)
    torch.testing.assert_close(ops.gelu_tanh_mul(gate_up), want, **TOL[dtype])


@needs_ops
@pytest.mark.parametrize("with_temperature", [False, True])
@pytest.mark.parametrize("with_rows", [False, True])
def test_exp_block_sums_match_float64_and_do_not_depend_on_the_batch(with_temperature, with_rows):
    x = torch.randn(6, 49152, generator=torch.Generator().manual_seed(7)) * 4
    x[:, -40:] = float("-inf")  # padding past the vocabulary
    t = torch.tensor([0.7, 1.0, 1.3, 0.5, 2.0, 1.0]) if with_temperature else None
    top = (x if t is None else x / t[:, None]).amax(dim=1)
    rows = torch.tensor([4, 1, 3]) if with_rows else None
    got = ops.exp_block_sums(x, top, t, rows, 64)
    picked = torch.arange(6) if rows is None else rows
    scaled = x.double() if t is None else x.double() / t.double()[:, None]
    want = (scaled - top.double()[:, None]).exp()[picked].view(len(picked), -1, 64).sum(dim=2)
    # rtol: x / t in float32 is off by up to half an ulp of |x / t| (~32 here), ~2e-6 in
    # the exponent, so exp(x / t - top) itself can differ from float64's by ~2e-6 relative.
    torch.testing.assert_close(got.double(), want, rtol=4e-6, atol=1e-9)  # a row sums to >= 1
    for i, r in enumerate(picked.tolist()):  # a row alone gives the same bits as inside the batch
        alone = ops.exp_block_sums(x, top, t, torch.tensor([r]), 64)
        assert torch.equal(alone[0], got[i])


@needs_ops
@pytest.mark.parametrize("vocab", [49152, 1000, 37])
def test_greedy_rows_take_the_first_maximum_and_the_logsumexp_whatever_the_batch(vocab):
    x = (torch.randn(6, vocab, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()
    x[1, vocab // 3] = x[1, vocab - 1] = x[1].max() + 1  # a tie: the lower id wins
    x[2] = x[2].clamp(max=0.5)  # many ties at the maximum, the first in the first block
    x[4, :vocab - 1] = float("-inf")  # one finite logit, the last
    tokens, lse = ops.greedy_rows(x, None)
    assert tokens.tolist() == x.float().argmax(dim=1).tolist()
    assert tokens[1] == vocab // 3 and tokens[4] == vocab - 1
    torch.testing.assert_close(lse.double(), torch.logsumexp(x.double(), dim=1), rtol=2e-6, atol=0)
    # The float32 copy gives the same bits; so does each row alone, on 1 thread or 2.
    assert all(torch.equal(a, b) for a, b in zip(ops.greedy_rows(x.float(), None), (tokens, lse)))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for r in (0, 4, 5):
                alone = ops.greedy_rows(x, torch.tensor([r]))
                assert alone[0][0] == tokens[r] and torch.equal(alone[1][0], lse[r])
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="row index"):
        ops.greedy_rows(x, torch.tensor([6]))
    with pytest.raises(RuntimeError, match="float32 or bf16"):
        ops.greedy_rows(x.half(), None)


@needs_ops
def test_torch_compile_traces_the_ops_by_their_fakes():
    # The kernels are registered for the CPU key with fakes (native_fakes.py):
    # inductor traces them as opaque calls in one graph, in-place update of
    # the residual included, and gets the eager results bit for bit.
    from tgi_kernels.native_fakes import FAKES

    assert all(torch._library.simple_registry.singleton.find(f"tgi::{name}").fake_impl.kernel is not None
               for name in FAKES if hasattr(ops, name))
    # Under ATEN_CPU_CAPABILITY below the CPU's own ISA (the AVX2 emulation run on an
    # AVX-512 machine), torch 2.13's inductor miscompiles even `a * 2 + b` (lanes past
    # the 8th are garbage): nothing of ours can be checked there.
    a, b = torch.randn(5, 32), torch.randn(5, 32)
    torch._dynamo.reset()
    if not torch.equal(torch.compile(lambda a, b: a * 2 + b, fullgraph=True)(a, b), a * 2 + b):
        pytest.skip("inductor miscompiles plain torch ops on this CPU setting")

    def block(x, residual, weight, gate_up):
        h = ops.add_rms_norm(x, residual, weight, 1e-6)  # residual += x
        return ops.rms_norm(h, weight, 1e-6) + ops.silu_mul(gate_up)

    # gate_up [5, 64] -> [5, 32]: no slice of an op's output in the graph. torch 2.13's
    # inductor gets `mm(a, w) + mm(c, w2)[:, :32]` wrong on this CPU by itself (plain
    # torch ops), writing a row's vector past the slice: not what this test is about.
    x, weight, gate_up = torch.randn(5, 32), torch.rand(32) + 0.5, torch.randn(5, 64)
    residual = torch.randn(5, 32)
    eager_residual, compiled_residual = residual.clone(), residual.clone()
    want = block(x, eager_residual, weight, gate_up)
    torch._dynamo.reset()
    got = torch.compile(block, fullgraph=True, dynamic=False)(x, compiled_residual, weight, gate_up)
    assert torch.equal(got, want) and torch.equal(compiled_residual, eager_residual)


@needs_ops
def test_layers_can_look_the_ops_up_inside_a_compiled_graph():
    # Layers call native_ops() at every forward: dynamo must read it as a
    # constant (a functools.cache'd loader was traced into, file checks and
    # all, breaking the graph at every layer).
    from tgi_kernels.native import native_ops

    x = torch.randn(3, 64)
    torch._dynamo.reset()
    got = torch.compile(lambda t: native_ops().silu_mul(t), fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(got, ops.silu_mul(x))
