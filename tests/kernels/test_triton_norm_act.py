"""The Triton kernels that fuse the per-token work of a layer on CUDA (RMSNorm
with its residual add, the gated activations, RoPE with the KV store)
against the torch ops they replace (CPU: Triton's interpreter, which rounds
float32 -> bf16 toward zero: one bf16 ulp of tolerance)."""

import pytest
import torch
import torch.nn.functional as F

from tgi_kernels import FP8_KV_DTYPES, rotary_store_kv, store_kv
from tgi_kernels import triton as triton_backend

from ..triton_interpreter import use_triton_interpreter

pytestmark = [pytest.mark.skipif(not use_triton_interpreter(), reason="needs triton")] + (
    [pytest.mark.gpu] if torch.cuda.is_available() else [])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}


def _norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), w.shape, w.float(), eps).to(x.dtype)


@DTYPES
@pytest.mark.parametrize("tokens, hidden", [(1, 2048), (5, 576), (3, 96)])
def test_rms_norm_matches_torch(dtype, tokens, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(tokens, hidden, generator=gen) * 3).to(dtype).to(DEVICE)
    w = torch.randn(hidden, generator=gen).to(dtype).to(DEVICE)
    torch.testing.assert_close(triton_backend.rms_norm(x, w, 1e-5), _norm_reference(x, w, 1e-5), **TOL[dtype])


@DTYPES
def test_rms_norm_after_the_residual_add_updates_the_residual_in_place(dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 576, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(4, 576, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(576, generator=gen).to(dtype).to(DEVICE)
    total = residual + x  # rounded to dtype, as the eager residual.add_(x)
    out = triton_backend.rms_norm(x, w, 1e-6, residual)
    torch.testing.assert_close(residual, total, atol=0, rtol=0 if dtype == torch.float32 else 8e-3)
    torch.testing.assert_close(out, _norm_reference(total, w, 1e-6), **TOL[dtype])


def test_rms_norm_reads_strided_rows():
    x = torch.randn(3, 128, device=DEVICE)[:, :64]  # row stride 128
    w = torch.randn(64, device=DEVICE)
    torch.testing.assert_close(triton_backend.rms_norm(x, w, 1e-5), _norm_reference(x, w, 1e-5), **TOL[torch.float32])


@DTYPES
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tokens, inter", [(1, 5632), (3, 1536), (2, 40)])
def test_gated_act_matches_torch(dtype, act, tokens, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(tokens, 2 * inter, generator=gen) * 3).to(dtype).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    want = (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
    torch.testing.assert_close(triton_backend.gated_act(gate_up, act), want, **TOL[dtype])


def _rotate(x, cos, sin):
    """Hugging Face's x * cos + rotate_half(x) * sin, each op in x's dtype (sin signed)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def _rotary_case(dtype, heads, kv_heads, dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = 5
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen) * 2).to(dtype).to(DEVICE)
    angles = torch.rand(tokens, 1, dim // 2, generator=gen) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype).to(DEVICE)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype).to(DEVICE)
    return qkv, cos, sin


@DTYPES
@pytest.mark.parametrize("heads, kv_heads, dim", [(6, 2, 16), (32, 4, 64), (3, 3, 80)])
def test_rotary_store_kv_rotates_q_and_k_and_stores_k_and_v(dtype, heads, kv_heads, dim):
    qkv, cos, sin = _rotary_case(dtype, heads, kv_heads, dim, seed=dim)
    k_cache = torch.zeros(4, 4, kv_heads, dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 9, 0, -1, 5], device=DEVICE)  # -1: a padding token, rotated but not stored
    want_qk = _rotate(qkv[:, :heads + kv_heads], cos, sin)
    want_v = qkv[:, heads + kv_heads:].clone()
    want_k_cache, want_v_cache = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    keep = slots >= 0
    store_kv(want_qk[keep, heads:], want_v[keep], want_k_cache, want_v_cache, slots[keep])

    rotary_store_kv(qkv, cos, sin, heads, k_cache, v_cache, slots, backend="triton")
    # bf16: each of the three roundings may be one ulp of the products (|x| ~ 4) off under the interpreter.
    tol = TOL[dtype] if dtype == torch.float32 else dict(atol=4e-2, rtol=1.6e-2)
    torch.testing.assert_close(qkv[:, :heads + kv_heads], want_qk, **tol)
    assert torch.equal(qkv[:, heads + kv_heads:], want_v)  # the value heads stay as they were
    torch.testing.assert_close(k_cache, want_k_cache, **tol)
    assert torch.equal(v_cache, want_v_cache)


@pytest.mark.parametrize("fp8", FP8_KV_DTYPES, ids=["e4m3fn", "e5m2"])
def test_rotary_store_kv_into_fp8_stores_what_store_kv_stores(fp8):
    heads, kv_heads, dim = 4, 2, 64
    qkv, cos, sin = _rotary_case(torch.bfloat16, heads, kv_heads, dim, seed=1)
    slots = torch.tensor([3, 0, 9, 12, 4], device=DEVICE)
    rotated = qkv.clone()
    rotary_store_kv(rotated, cos, sin, heads, torch.zeros(4, 4, kv_heads, dim, dtype=fp8, device=DEVICE),
                    torch.zeros(4, 4, kv_heads, dim, dtype=fp8, device=DEVICE), slots, backend="triton")
    k_want, v_want = (torch.zeros(4, 4, kv_heads, dim, dtype=fp8, device=DEVICE) for _ in range(2))
    store_kv(rotated[:, heads:heads + kv_heads], rotated[:, heads + kv_heads:], k_want, v_want, slots,
             backend="triton", k_scale=0.25, v_scale=2.0)
    k8, v8 = (torch.zeros(4, 4, kv_heads, dim, dtype=fp8, device=DEVICE) for _ in range(2))
    rotary_store_kv(qkv, cos, sin, heads, k8, v8, slots, k_scale=0.25, v_scale=2.0, backend="triton")
    assert torch.equal(qkv, rotated)  # the scales change what is stored, not the rotation
    assert torch.equal(k8.view(torch.uint8), k_want.view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), v_want.view(torch.uint8))
