"""The flash_attn backend's own code (gathers, offsets, argument mapping), run on CPU.

flash-attn itself needs CUDA, so here it is replaced by a stand-in that follows
its documented contract (bottom-right causal alignment, window (left, right),
cache_seqlens, block_table) using the reference math. This checks everything
our flash.py does around the kernel; the CUDA tests check the kernel itself.
"""

from types import SimpleNamespace

import pytest
import torch

from tgi_kernels import flash, paged_decode, reference, varlen_prefill

from .kernel_cases import make_case, make_decode_case


def _dense(q, k, v, softmax_scale, causal, window_size, softcap=0.0):
    # q [n, H, D], k/v [m, KVH, D]; flash aligns the causal mask to the bottom right.
    assert causal
    left, right = window_size
    assert right in (0, -1)
    q_pos = torch.arange(q.shape[0]) + (k.shape[0] - q.shape[0])
    return reference.attend(q, k, v, q_pos, softmax_scale, left + 1 if left >= 0 else 0, softcap)


def _varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size, softcap=0.0):
    assert cu_q.dtype == cu_k.dtype == torch.int32
    out = torch.empty_like(q)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    assert max_q == max(b - a for a, b in zip(cu_q, cu_q[1:]))
    assert max_k == max(b - a for a, b in zip(cu_k, cu_k[1:]))
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        out[qs] = _dense(q[qs], k[ks], v[ks], softmax_scale, causal, window_size, softcap)
    return out


def _with_kvcache(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal, window_size, block_table=None,
                  softcap=0.0):
    assert cache_seqlens.dtype == torch.int32 and q.shape[1] == 1
    out = torch.empty_like(q)  # [B, 1, H, D]
    for b, n in enumerate(cache_seqlens.tolist()):
        if block_table is None:
            k, v = k_cache[b, :n], v_cache[b, :n]
        else:
            assert block_table.dtype == torch.int32 and k_cache.shape[1] % 256 == 0
            k, v = reference.read_context(k_cache, v_cache, block_table[b], n)
        out[b] = _dense(q[b], k, v, softmax_scale, causal, window_size, softcap)
    return out


@pytest.fixture
def fake_flash(monkeypatch):
    fake = SimpleNamespace(flash_attn_varlen_func=_varlen_func, flash_attn_with_kvcache=_with_kvcache)
    monkeypatch.setattr(flash, "_flash", lambda: fake)


@pytest.mark.parametrize("block_size", [4, 256])
@pytest.mark.parametrize("sliding_window, softcap", [(0, 0.0), (5, 0.0), (5, 0.5)])
def test_flash_decode_glue_matches_reference(fake_flash, block_size, sliding_window, softcap):
    case = make_decode_case(
        [1, 4, 5, 23], heads=6, kv_heads=2, head_dim=16, block_size=block_size, dtype=torch.bfloat16
    )
    args = (case.query, case.k_cache, case.v_cache, case.decode, 0.25, sliding_window)
    got = flash.paged_decode(*args, softcap)
    torch.testing.assert_close(got, paged_decode(*args, backend="reference", softcap=softcap))


@pytest.mark.parametrize("prefix_lens", [[0, 0, 0], [3, 0, 17]], ids=["fresh", "prefix"])
@pytest.mark.parametrize("sliding_window, softcap", [(0, 0.0), (5, 0.0), (5, 0.5)])
def test_flash_prefill_glue_matches_reference(fake_flash, prefix_lens, sliding_window, softcap):
    case = make_case(
        [6, 1, 9], prefix_lens, heads=6, kv_heads=2, head_dim=16, block_size=4, dtype=torch.bfloat16
    )
    args = (case.query, case.key, case.value, case.k_cache, case.v_cache, case.prefill, 0.25, sliding_window)
    got = flash.varlen_prefill(*args, softcap)
    torch.testing.assert_close(got, varlen_prefill(*args, backend="reference", softcap=softcap))


def test_flash_falls_back_to_sdpa_for_float32(monkeypatch):
    monkeypatch.setattr(flash, "_flash", lambda: None)  # any call into flash-attn would fail
    case = make_decode_case([3, 8], heads=2, kv_heads=1, head_dim=8, block_size=4)
    args = (case.query, case.k_cache, case.v_cache, case.decode, 0.5)
    torch.testing.assert_close(flash.paged_decode(*args), paged_decode(*args, backend="reference"))


@pytest.mark.parametrize("block_size", [4, 256])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3fn", "e5m2"])
def test_flash_reads_a_fp8_cache_through_widened_gathers(fake_flash, block_size, fp8):
    """flash-attn 2 takes 16-bit caches only: a float8 cache's blocks are gathered
    (paged or not) and widened to the query's dtype first. With a cached prefix
    flash reads the chunk's own keys back from the cache too: rounded."""
    decode = make_decode_case([1, 5, 23], heads=6, kv_heads=2, head_dim=16, block_size=block_size,
                              dtype=torch.bfloat16)
    k8, v8 = decode.k_cache.to(fp8), decode.v_cache.to(fp8)
    widened = (k8.to(torch.bfloat16), v8.to(torch.bfloat16))
    torch.testing.assert_close(flash.paged_decode(decode.query, k8, v8, decode.decode, 0.25),
                               paged_decode(decode.query, *widened, decode.decode, 0.25, backend="reference"))
    case = make_case([6, 1, 9], [3, 0, 17], heads=6, kv_heads=2, head_dim=16, block_size=4, dtype=torch.bfloat16)
    k8, v8 = case.k_cache.to(fp8), case.v_cache.to(fp8)
    rounded = (case.key.to(fp8).to(torch.bfloat16), case.value.to(fp8).to(torch.bfloat16))
    torch.testing.assert_close(
        flash.varlen_prefill(case.query, case.key, case.value, k8, v8, case.prefill, 0.25),
        varlen_prefill(case.query, *rounded, k8.to(torch.bfloat16), v8.to(torch.bfloat16), case.prefill, 0.25,
                       backend="reference"))
