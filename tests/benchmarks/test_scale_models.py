"""benchmarks/scale_models.py on small shapes of the same two families: the
GGUF files carry llama.cpp's Q4_K_M mix (with its fallbacks for rows that
do not split into 256-value blocks) or Q4_0 throughout, and our own GGUF
loader reads back the hf/ checkpoint's weights within the blocks' rounding,
Llama's Q and K rows included (permuted on write, restored on load)."""

import gguf
import pytest
import torch
from safetensors.torch import load_file

from benchmarks.scale_models import build, use_more_bits
from tgi_server.weights.gguf import load_gguf
from tgi_server.weights.gguf_reader import FastGGUFReader

Q = gguf.GGMLQuantizationType
SMALL = {
    # 256-wide rows: Q4_K and Q6_K themselves; 8 layers: use_more_bits picks 0, 3, 6 and 7
    "llama": dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=500000.0,
                  rms_norm_eps=1e-5, max_position_embeddings=2048, tie_word_embeddings=True),
    # 192-wide rows, as Qwen2.5-0.5B's 896: the fallbacks Q5_0 and Q8_0 (ffn_down's 512 keeps Q4_K/Q6_K)
    "qwen2": dict(model_type="qwen2", hidden_size=192, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=3, num_key_value_heads=1, rope_theta=1e6, rms_norm_eps=1e-6,
                  max_position_embeddings=2048, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scale")
    return {family: build(family, folder, shape) for family, shape in SMALL.items()}


def types(path) -> dict[str, Q]:
    return {t.name: t.tensor_type for t in FastGGUFReader(path).tensors}


def test_use_more_bits_is_llama_cpps_pick():
    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]


def test_the_q4_k_m_mix(built):
    llama = types(built["llama"] / "q4_k_m.gguf")
    assert llama["token_embd.weight"] == Q.Q6_K and llama["output_norm.weight"] == Q.F32
    for i in range(8):
        more = Q.Q6_K if i in (0, 3, 6, 7) else Q.Q4_K
        assert llama[f"blk.{i}.attn_v.weight"] == llama[f"blk.{i}.ffn_down.weight"] == more
        assert {llama[f"blk.{i}.{n}.weight"] for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} \
            == {Q.Q4_K}
    qwen = types(built["qwen2"] / "q4_k_m.gguf")
    assert qwen["token_embd.weight"] == Q.Q8_0  # Q6_K's fallback at 192 columns
    assert qwen["blk.0.attn_q.weight"] == qwen["blk.0.ffn_up.weight"] == Q.Q5_0  # Q4_K's
    # two layers: use_more_bits picks layer 1 only
    assert qwen["blk.0.attn_v.weight"] == Q.Q5_0 and qwen["blk.0.ffn_down.weight"] == Q.Q4_K
    assert qwen["blk.1.attn_v.weight"] == Q.Q8_0 and qwen["blk.1.ffn_down.weight"] == Q.Q6_K
    assert qwen["blk.0.attn_q.bias"] == Q.F32


def test_q4_0_throughout(built):
    for folder in built.values():
        assert {t for name, t in types(folder / "q4_0.gguf").items() if name.endswith(".weight")
                and "norm" not in name} == {Q.Q4_0}


@pytest.mark.parametrize("family", SMALL)
@pytest.mark.parametrize("kind", ["q4_0", "q4_k_m"])
def test_our_loader_reads_the_weights_back(built, family, kind):
    dense = load_file(built[family] / "hf" / "model.safetensors")
    read = load_gguf(built[family] / f"{kind}.gguf", torch.float32).tensors
    assert set(dense) - {"lm_head.weight"} <= set(read)
    for name, weight in dense.items():
        if name in read:
            error = (read[name] - weight.float()).norm() / weight.float().norm().clamp(min=1e-12)
            assert error < 0.15, (name, float(error))  # a wrong row order would be ~1.4
