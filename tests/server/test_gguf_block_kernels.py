"""GGUF linears served from their blocks beyond Q4_0 / Q4_1:
- Q4_K (llama.cpp's 4-bit K-quant, the bulk of a Q4_K_M file) on the int4
  kernel: decoded exactly as gguf-py dequantizes it, served to the logits of
  transformers holding those values. gguf-py cannot write Q4_K, so
  `q4_k_blocks` below does (plain min / max rounding, llama.cpp's layout).
- Q8_0 on GroupedInt8's int8 kernel where its int8 activations run (bf16 on
  AVX512-VNNI), against the same file served dense."""

import gguf
import numpy as np
import pytest
import torch

from tgi_proto import pb
from tgi_server.distributed import TensorParallel
from tgi_server.model_loader import load_model, open_checkpoint
from tgi_server.model_runner import ModelRunner
from tgi_server.quant.gguf_linear import decode_q4_k, decode_q8_0
from tgi_server.quant.grouped_int8 import GroupedInt8
from tgi_server.quant.quant_linear import QuantLinear
from tgi_server.weights.resolve import resolve_model

from ..shard_harness import save_tiny_model
from .test_engine_matches_hf import engine_logits
from .test_gguf_families import PROMPTS, convert, reference
from .test_quant_models import hf_logits, runner_for

Q = gguf.GGMLQuantizationType


def q4_k_blocks(x: np.ndarray) -> np.ndarray:
    """x [..., K] float32 (K a multiple of 256) -> Q4_K blocks [..., K / 256 * 144] uint8."""
    lead, k = x.shape[:-1], x.shape[-1]
    g = x.reshape(-1, k // 256, 8, 32).astype(np.float32)  # [rows, super-blocks, group, element]
    lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
    d = ((hi - lo) / 15).max(-1) / 63  # the super-block's scale of the groups' scales
    dmin = (-lo).max(-1) / 63
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    df, dmf = d16.astype(np.float32)[..., None], dmin16.astype(np.float32)[..., None]
    sc = np.clip(np.round((hi - lo) / 15 / np.where(df > 0, df, 1)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / np.where(dmf > 0, dmf, 1)), 0, 63).astype(np.uint8)
    step, floor = (df * sc)[..., None], (dmf * m)[..., None]
    q = np.clip(np.round((g + floor) / np.where(step > 0, step, 1)), 0, 15).astype(np.uint8)
    packed = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)], axis=-1)  # [rows, S, 12]
    q = q.reshape(*q.shape[:2], 4, 2, 32)  # groups 2c and 2c + 1 share chunk c's bytes
    nibbles = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(*q.shape[:2], 128)
    rows, s = g.shape[:2]
    out = np.concatenate([d16.view(np.uint8).reshape(rows, s, 2), dmin16.view(np.uint8).reshape(rows, s, 2),
                          packed, nibbles], axis=-1)
    return out.reshape(*lead, k // 256 * 144)


def test_blocks_decode_exactly_as_gguf_dequantizes_them():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 512)).astype(np.float32)
    encoded = q4_k_blocks(x)
    # every bit pattern of the 6-bit scales and mins and of the nibbles, with finite d and dmin
    raw = rng.integers(0, 256, (48, 2 * 144), dtype=np.uint8)
    raw.reshape(48, 2, 144)[..., 0:4] = rng.uniform(-0.1, 0.1, (48, 2, 2)).astype(np.float16).view(np.uint8)
    for blocks in (encoded, raw):
        want = gguf.quants.dequantize(blocks, Q.Q4_K)
        got = decode_q4_k(blocks).dequantize(torch.float32).numpy()
        np.testing.assert_array_equal(got, want)
    # the test's own writer: within half a step of each group
    assert np.abs(gguf.quants.dequantize(encoded, Q.Q4_K) - x).max() < 0.25


@pytest.mark.parametrize("model_type", ["phi3", "mixtral"])
def test_prefill_logits_equal_transformers_on_the_dequantized_weights(model_type, tmp_path, monkeypatch):
    """Fused qkv / gate_up (phi3) and stacked experts (mixtral) in Q4_K, each
    linear's K a multiple of 256."""
    quantize = gguf.quants.quantize
    monkeypatch.setattr(gguf.quants, "quantize", lambda data, qtype: q4_k_blocks(data) if qtype == Q.Q4_K
                        else quantize(data, qtype))
    source = save_tiny_model(model_type, tmp_path / model_type, hidden_size=256, num_attention_heads=16,
                             intermediate_size=256)
    path = tmp_path / f"{model_type}.Q4_K.gguf"
    stands_for = convert(model_type, source, path, Q.Q4_K)
    runner = runner_for(path)
    assert {m.kernel for m in runner.model.modules() if isinstance(m, QuantLinear)} == {"int4"}
    model = reference(model_type, source, stands_for, tmp_path)
    for prompt in PROMPTS:  # the int4 kernel sums in another order than transformers: as for Q4_0
        assert (engine_logits(runner, prompt) - hf_logits(model, prompt)).abs().max() < 4e-3


def test_q8_0_blocks_decode_exactly_as_gguf_dequantizes_them():
    blocks = gguf.quants.quantize(np.random.default_rng(1).standard_normal((40, 256)).astype(np.float32), Q.Q8_0)
    np.testing.assert_array_equal(decode_q8_0(blocks).dequantize(torch.float32).numpy(),
                                  gguf.quants.dequantize(blocks, Q.Q8_0))


def bf16_runner(path) -> ModelRunner:
    config, weights = open_checkpoint(resolve_model(str(path)), torch.bfloat16, torch.device("cpu"))
    runner = ModelRunner(load_model(config, weights, TensorParallel()), 16, attention_backend=None,
                         kv_cache_bytes=16 << 20)
    runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_batch_size=4))
    return runner


@pytest.mark.skipif(not GroupedInt8.serves(torch.bfloat16, torch.device("cpu")),
                    reason="needs AVX512-VNNI and our C++ kernels")
@pytest.mark.parametrize("model_type", ["phi3", "mixtral"])
def test_q8_0_linears_in_bf16_run_the_int8_kernel_about_as_near_float32_as_dense_bf16(model_type, tmp_path,
                                                                                       monkeypatch):
    source = save_tiny_model(model_type, tmp_path / model_type)
    path = tmp_path / f"{model_type}.Q8_0.gguf"
    convert(model_type, source, path, Q.Q8_0)
    ours = bf16_runner(path)
    assert {m.kernel for m in ours.model.modules() if isinstance(m, QuantLinear)} == {"grouped_int8"}
    exact = runner_for(path)  # float32: dense, as before
    monkeypatch.setattr(GroupedInt8, "serves", staticmethod(lambda dtype, device: False))
    dense = bf16_runner(path)
    assert not any(isinstance(m, QuantLinear) for m in dense.model.modules())

    def error(runner: ModelRunner, prompt: list[int], want: torch.Tensor) -> float:
        """The median over tokens of their logits' largest error from want: robust
        to one token whose experts a rounding flips (mixtral)."""
        return float((engine_logits(runner, prompt).float() - want).abs().amax(-1).median())
    for prompt in PROMPTS:
        want = engine_logits(exact, prompt).float()
        # x rounded to int8 per 32 columns (llama.cpp's Q8_0 x Q8_0) on top of
        # bf16's rounding: 0.9-1.6x the dense bf16 model's error here
        assert error(ours, prompt, want) < 2 * error(dense, prompt, want)
