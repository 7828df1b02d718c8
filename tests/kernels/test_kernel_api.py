"""store_kv, backend selection and the metadata builders."""

import inspect

import pytest
import torch

import tgi_kernels
from tgi_kernels import available_backends, build_prefill_meta, cpu, select_backend, store_kv
from tgi_kernels.attention import BACKENDS, AttentionBackend
from tgi_kernels.native import native_ops

CPU = torch.device("cpu")


def test_store_kv_writes_each_token_to_its_slot_and_nothing_else():
    num_blocks, block_size, kv_heads, head_dim = 4, 3, 2, 5
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    key = torch.randn(4, kv_heads, head_dim)
    value = torch.randn(4, kv_heads, head_dim)
    slots = torch.tensor([2 * 3 + 1, 0, 3 * 3 + 2, 1 * 3 + 0])  # block * block_size + offset
    store_kv(key, value, k_cache, v_cache, slots)

    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        assert torch.equal(k_cache[block, offset], key[t])
        assert torch.equal(v_cache[block, offset], value[t])
        written[block, offset] = True
    assert not k_cache[~written].any() and not v_cache[~written].any()


def test_store_kv_casts_to_the_cache_dtype():
    k_cache = torch.zeros(2, 2, 1, 4, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(1, 1, 4)
    store_kv(key, key, k_cache, v_cache, torch.tensor([3]))
    assert torch.equal(k_cache[1, 1], key[0].to(torch.bfloat16))


def test_cpu_offers_reference_and_sdpa():
    assert available_backends(CPU)[:2] == ["reference", "sdpa"]
    if not torch.cuda.is_available():
        assert "flash_attn" not in available_backends(CPU)


def test_default_backend_on_cpu_is_our_cpu_kernels_where_they_build(monkeypatch):
    assert select_backend(CPU) == ("cpu" if native_ops() is not None else "sdpa")
    monkeypatch.setattr(cpu, "is_available", lambda device: False)  # no compiler
    assert "cpu" not in available_backends(CPU) and select_backend(CPU) == "sdpa"


def test_forced_backend_is_honoured():
    assert select_backend(CPU, forced="reference") == "reference"


@pytest.mark.parametrize("name", ["nope", "flash_attn"])
def test_unknown_or_unavailable_backend_raises_naming_the_available_ones(name):
    with pytest.raises(ValueError, match="reference, sdpa"):
        select_backend(CPU, forced=name)


def test_calling_an_unknown_backend_raises():
    with pytest.raises(ValueError, match="nope"):
        tgi_kernels.paged_decode(torch.zeros(1, 1, 4), k_cache=None, v_cache=None, meta=None, scale=1.0,
                                 backend="nope")


def test_build_prefill_meta_packs_offsets_and_pads_block_tables():
    meta = build_prefill_meta([3, 1], [0, 5], [[7], [2, 4]])
    assert meta.cu_seqlens_q.tolist() == [0, 3, 4]
    assert meta.cu_seqlens_q.dtype == torch.int32
    assert meta.prefix_lens.tolist() == [0, 5]
    assert meta.block_tables.tolist() == [[7, 0], [2, 4]]
    assert meta.block_tables.dtype == torch.int32
    assert (meta.max_query_len, meta.max_seq_len) == (3, 6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_default_backend_on_cuda_is_flash_attn_then_triton_then_sdpa():
    cuda = torch.device("cuda")
    expected = next(name for name in ("flash_attn", "triton", "sdpa") if name in available_backends(cuda))
    assert select_backend(cuda) == expected


@pytest.mark.parametrize("flash_ok, triton_ok, expected", [
    (True, True, "flash_attn"), (False, True, "triton"), (False, False, "sdpa"),
])
def test_cuda_default_prefers_flash_attn_then_triton_then_sdpa(monkeypatch, flash_ok, triton_ok, expected):
    from tgi_kernels import flash
    from tgi_kernels import triton as triton_backend

    monkeypatch.setattr(flash, "is_available", lambda device: flash_ok)
    monkeypatch.setattr(triton_backend, "is_available", lambda device: triton_ok)
    assert select_backend(torch.device("cuda")) == expected


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_module_has_the_protocol_s_signatures(name):
    module = BACKENDS[name]
    for function in ("paged_decode", "varlen_prefill"):
        want = list(inspect.signature(getattr(AttentionBackend, function)).parameters)[1:]  # without self
        assert list(inspect.signature(getattr(module, function)).parameters) == want, (name, function)
