"""The Triton kernels against the plain-torch reference (CPU: Triton's interpreter).

Shapes are representative rather than a full product, to keep the interpreter
within CI's budget: block boundaries (lengths 15/16/17, 63/64/65), lengths
from 1 to 2,048, GQA ratios 1/3/8, head sizes 64/128. Errors: within 2e-3
absolute, plus the output dtype's own rounding (the interpreter rounds
float32 -> bf16 toward zero, the reference to nearest: one bf16 ulp).
"""

import pytest
import torch

from tgi_kernels import available_backends, paged_decode, store_kv, varlen_prefill
from tgi_kernels import triton as triton_backend

from ..triton_interpreter import use_triton_interpreter
from .kernel_cases import make_case, make_decode_case

# On a GPU machine the same tests run the compiled kernels, and belong to `pytest -m gpu`.
pytestmark = [pytest.mark.skipif(not use_triton_interpreter(), reason="needs triton")] + (
    [pytest.mark.gpu] if torch.cuda.is_available() else [])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {
    torch.float32: dict(atol=2e-3, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=2e-3, rtol=1.6e-2),
}
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def _reference_decode(case, scale, window):
    return paged_decode(case.query, case.k_cache, case.v_cache, case.decode, scale, window, backend="reference")


def _reference_prefill(case, scale, window):
    return varlen_prefill(case.query, case.key, case.value, case.k_cache, case.v_cache, case.prefill,
                          scale, window, backend="reference")


# --- store_kv ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["fp32", "fp16", "bf16"])
def test_store_kv_writes_each_token_to_its_slot_and_nothing_else(dtype):
    k_cache = torch.zeros(5, 4, 3, 64, dtype=dtype, device=DEVICE)  # [blocks, block_size, KVH, D]
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(6, 4 + 2 * 3, 64, device=DEVICE).to(dtype)  # a fused projection: strided k/v views
    key, value = qkv[:, 4:7], qkv[:, 7:]
    slots = torch.tensor([17, 0, 3, 4, 19, 9], device=DEVICE)  # crosses blocks, first and last slots
    store_kv(key, value, k_cache, v_cache, slots, backend="triton")

    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    store_kv(key, value, want_k, want_v, slots, backend="sdpa")
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_store_kv_skips_negative_padding_slots():
    k_cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(3, 1, 16, device=DEVICE)
    store_kv(key, key, k_cache, v_cache, torch.tensor([5, -1, 2], device=DEVICE), backend="triton")
    flat = k_cache.view(-1, 16)
    assert torch.equal(flat[5], key[0, 0]) and torch.equal(flat[2], key[2, 0])
    assert flat.count_nonzero(dim=1).nonzero().flatten().tolist() == [2, 5]


def test_store_kv_casts_to_the_cache_dtype_within_one_ulp():
    k_cache = torch.zeros(2, 2, 1, 32, dtype=BF16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(1, 1, 32, device=DEVICE)
    store_kv(key, key, k_cache, v_cache, torch.tensor([3], device=DEVICE), backend="triton")
    torch.testing.assert_close(k_cache[1, 1].float(), key[0].float(), atol=0, rtol=2**-7)


# --- paged decode ----------------------------------------------------------------------

# (seq_lens, block_size, group, head_dim, dtype): every GQA ratio, head size and dtype,
# lengths on and around block and tile boundaries, and one long context.
DECODE_CASES = {
    "bs16-gqa1-d64": ([1, 15, 16, 17, 63, 64, 65], 16, 1, 64, F16),
    "bs16-gqa3-d128": ([2, 31, 32, 33, 100], 16, 3, 128, BF16),
    "bs4-gqa8-d64": ([1, 3, 4, 5, 9, 30], 4, 8, 64, F16),
    "bs32-gqa8-d128-long": ([2048, 1000, 1], 32, 8, 128, BF16),
    "bs16-gqa3-d64-fp32": ([7, 129], 16, 3, 64, F32),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
@pytest.mark.parametrize("window", [0, 37], ids=["full", "window37"])
def test_decode_matches_reference(name, window):
    seq_lens, block_size, group, head_dim, dtype = DECODE_CASES[name]
    case = make_decode_case(seq_lens, heads=2 * group if group < 8 else group, kv_heads=2 if group < 8 else 1,
                            head_dim=head_dim, block_size=block_size, dtype=dtype, device=DEVICE, seed=len(name))
    scale = head_dim ** -0.5
    got = triton_backend.paged_decode(case.query, case.k_cache, case.v_cache, case.decode, scale, window)
    assert got.shape == case.query.shape and got.dtype == dtype
    torch.testing.assert_close(got, _reference_decode(case, scale, window), **TOLERANCE[dtype])


@pytest.mark.parametrize("window", [0, 70], ids=["full", "window70"])
def test_decode_split_over_partitions_matches_reference(window):
    # Partitions of 64 tokens: 700 tokens run as 11 splits, merged 8 at a time; a
    # window of 70 leaves the first 9 empty (a whole merge chunk); the short
    # sequences leave the later splits empty.
    from tgi_kernels.triton.paged_decode_kernel import paged_decode as decode_kernel

    case = make_decode_case([700, 64, 65, 1], heads=6, kv_heads=2, head_dim=64, block_size=16, dtype=F16,
                            device=DEVICE, seed=7)
    meta = case.decode
    got = decode_kernel(case.query, case.k_cache, case.v_cache, meta.block_tables, meta.seq_lens,
                        meta.max_seq_len, 0.125, window, partition=64)
    torch.testing.assert_close(got, _reference_decode(case, 0.125, window), **TOLERANCE[F16])


def test_decode_with_a_larger_split_bound_gives_the_same_result():
    # A CUDA graph replays with max_seq_len fixed at its capture bound: extra
    # splits past every sequence's end must contribute nothing.
    from tgi_kernels.triton.paged_decode_kernel import paged_decode as decode_kernel

    case = make_decode_case([40, 3], heads=4, kv_heads=2, head_dim=64, block_size=16, dtype=F16, device=DEVICE)
    meta = case.decode
    tight = decode_kernel(case.query, case.k_cache, case.v_cache, meta.block_tables, meta.seq_lens, 40, 0.125)
    loose = decode_kernel(case.query, case.k_cache, case.v_cache, meta.block_tables, meta.seq_lens,
                          1024, 0.125, partition=64)
    torch.testing.assert_close(loose, tight, **TOLERANCE[F16])


def test_decode_reads_only_the_blocks_of_each_table_up_to_its_length():
    # Every cache slot a sequence does not own (other blocks, the tail of its last
    # block, what padding entries point at) holds NaN: one stray read would show.
    case = make_decode_case([5, 16, 33], heads=4, kv_heads=2, head_dim=64, block_size=8, dtype=F16,
                            device=DEVICE, seed=11)
    want = _reference_decode(case, 0.125, 0)
    owned = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool, device=DEVICE)
    for b, n in enumerate(case.decode.seq_lens.tolist()):
        pos = torch.arange(n, device=DEVICE)
        owned[case.decode.block_tables[b].long()[pos // 8], pos % 8] = True
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    k_cache[~owned] = float("nan")
    v_cache[~owned] = float("nan")
    got = triton_backend.paged_decode(case.query, k_cache, v_cache, case.decode, 0.125)
    torch.testing.assert_close(got, want, **TOLERANCE[F16])


def test_decode_follows_a_block_shared_by_two_tables():
    # Prefix caching: two sequences whose tables start with the same block.
    case = make_decode_case([20, 20], heads=2, kv_heads=1, head_dim=64, block_size=16, dtype=F16,
                            device=DEVICE, seed=3)
    tables = case.decode.block_tables.clone()
    tables[1, 0] = tables[0, 0]
    meta = type(case.decode)(block_tables=tables, seq_lens=case.decode.seq_lens, max_seq_len=20)
    args = (case.query, case.k_cache, case.v_cache, meta, 0.125)
    torch.testing.assert_close(triton_backend.paged_decode(*args), paged_decode(*args, backend="reference"),
                               **TOLERANCE[F16])


# --- varlen prefill ----------------------------------------------------------------------

# (query_lens, prefix_lens, block_size, group, head_dim, dtype)
PREFILL_CASES = {
    "fresh-gqa1-d64": ([1, 7, 16, 17, 64, 65], [0] * 6, 16, 1, 64, F16),
    "chunked-gqa3-d128": ([5, 16, 1, 9, 3], [3, 16, 40, 0, 1], 4, 3, 128, BF16),
    "chunked-gqa8-d64": ([20, 1, 16, 33], [17, 31, 16, 0], 16, 8, 64, F16),
    "long-prefix-gqa8-d128": ([48, 1], [2000, 2047], 32, 8, 128, BF16),
    "fresh-gqa3-d64-fp32": ([30, 2], [0, 0], 16, 3, 64, F32),
}


@pytest.mark.parametrize("name", list(PREFILL_CASES))
@pytest.mark.parametrize("window", [0, 37], ids=["full", "window37"])
def test_prefill_matches_reference(name, window):
    query_lens, prefix_lens, block_size, group, head_dim, dtype = PREFILL_CASES[name]
    case = make_case(query_lens, prefix_lens, heads=2 * group if group < 8 else group,
                     kv_heads=2 if group < 8 else 1, head_dim=head_dim, block_size=block_size,
                     dtype=dtype, device=DEVICE, seed=len(name))
    scale = head_dim ** -0.5
    got = triton_backend.varlen_prefill(case.query, case.key, case.value, case.k_cache, case.v_cache,
                                        case.prefill, scale, window)
    assert got.shape == case.query.shape and got.dtype == dtype
    torch.testing.assert_close(got, _reference_prefill(case, scale, window), **TOLERANCE[dtype])


def test_prefill_reads_the_prefix_from_the_cache_and_the_chunk_from_key_value():
    # Poison the chunk's own cache slots: the kernel must take the chunk from key/value.
    case = make_case([6, 3], [5, 0], heads=4, kv_heads=2, head_dim=64, block_size=4, dtype=F16,
                     device=DEVICE, seed=5)
    want = _reference_prefill(case, 0.125, 0)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    for b, (n, prefix) in enumerate(zip(case.query_lens, case.prefix_lens)):
        pos = torch.arange(prefix, prefix + n, device=DEVICE)
        blocks = case.prefill.block_tables[b].long()[pos // 4]
        k_cache[blocks, pos % 4] = float("nan")
        v_cache[blocks, pos % 4] = float("nan")
    got = triton_backend.varlen_prefill(case.query, case.key, case.value, k_cache, v_cache, case.prefill, 0.125)
    torch.testing.assert_close(got, want, **TOLERANCE[F16])


# --- the backend as tgi_kernels offers it ---------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the interpreter is off: triton runs on the GPU only")
def test_triton_is_offered_but_never_the_default_on_cpu():
    cpu = torch.device("cpu")
    assert "triton" in available_backends(cpu)
    assert paged_decode.__module__ == "tgi_kernels.attention"
    from tgi_kernels import select_backend

    assert select_backend(cpu) in ("cpu", "sdpa")
    assert select_backend(cpu, forced="triton") == "triton"


def test_backend_name_routes_decode_to_the_triton_kernels():
    case = make_decode_case([9], heads=2, kv_heads=1, head_dim=64, block_size=4, dtype=F16, device=DEVICE)
    args = (case.query, case.k_cache, case.v_cache, case.decode, 0.125)
    torch.testing.assert_close(paged_decode(*args, backend="triton"), triton_backend.paged_decode(*args))
