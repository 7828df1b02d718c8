"""GGUF checkpoints load into Hugging Face names, layout and config.

Tiny random GGUF files are written here with gguf.GGUFWriter the way
llama.cpp's converter writes them (q/k rows permuted for llama); SmolLM2's
real file checks config facts, the tokenizer and, through greedy text, that
the permutation is undone.
"""

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tgi_server.weights.errors import CheckpointError
from tgi_server.weights.gguf import GGUFFile, load_gguf, load_gguf_tokenizer
from tgi_server.weights.gguf_reader import dequantize
from tgi_server.weights.source import GGUFSource

Q = gguf.GGMLQuantizationType
TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=96, layers=2)
GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_hf_tensors(bias: bool, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, q, kv, i, v = TINY["hidden"], TINY["heads"] * TINY["head_dim"], TINY["kv_heads"] * TINY["head_dim"], \
        TINY["inter"], TINY["vocab"]
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not tied:
        out["lm_head.weight"] = (v, h)
    for layer in range(TINY["layers"]):
        p = f"model.layers.{layer}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i)})
        if bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in out.items()}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{suffix}"


def write_tiny_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], qtype=Q.F32, name=None,
                    permute=True, theta=500000.0, extra=None, extra_tensors=None) -> Path:
    """A GGUF file as llama.cpp's converter writes it: 2-D weights in `qtype`, norms/biases F32."""
    writer = gguf.GGUFWriter(path, arch)
    if name:
        writer.add_name(name)
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["inter"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for setter, value in (extra or {}).items():
        getattr(writer, setter)(value)
    for hf_name, data in tensors.items():
        if permute and ".q_proj." in hf_name:
            data = llama_cpp_permute(data, TINY["heads"])
        if permute and ".k_proj." in hf_name:
            data = llama_cpp_permute(data, TINY["kv_heads"])
        if data.ndim == 2 and qtype != Q.F32:
            writer.add_tensor(gguf_name(hf_name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(hf_name), data)
    for name_, data in (extra_tensors or {}).items():
        writer.add_tensor(name_, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantized(data: np.ndarray, qtype) -> np.ndarray:
    """What gguf itself gives back for `data` stored as `qtype`."""
    if data.ndim != 2 or qtype == Q.F32:
        return data
    return gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)


# ---------------------------------------------------------------- tiny files


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_llama_tensors_round_trip_with_q_k_unpermuted(tmp_path, qtype):
    hf = tiny_hf_tensors(bias=False, tied=True)
    ckpt = load_gguf(write_tiny_gguf(tmp_path / "llama.gguf", "llama", hf, qtype), torch.float32)
    assert set(ckpt.tensors) == set(hf)
    for name, want in hf.items():
        got = ckpt.tensors[name].numpy()
        assert got.shape == want.shape, name
        # Row permutation commutes with llama.cpp's row-wise block quantization.
        np.testing.assert_array_equal(got, quantized(want, qtype), err_msg=name)


@pytest.mark.parametrize("qtype", sorted(gguf.quants._type_traits), ids=lambda q: q.name)
def test_our_dequantize_is_gguf_pys_to_the_bit(qtype):
    """Every block type gguf-py decodes, on random bytes (NaNs and infinities
    included), [experts, rows, bytes] as stacked tensors are stored, over
    chunks of one row, of a few blocks and of the whole: the loader's (and,
    through the fast_gguf_reader fixture, transformers') values are gguf-py's."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = np.random.default_rng(int(qtype)).integers(0, 256, (2, 37, 3 * size), dtype=np.uint8)
    with np.errstate(all="ignore"):
        want = gguf.quants.dequantize(data, qtype)
        for chunk in (1, 5 * block, 1 << 16):
            got = dequantize(data, qtype, chunk)
            assert got.shape == want.shape and got.dtype == want.dtype == np.float32
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_quantized_weights_stay_close_to_the_originals(tmp_path):
    hf = tiny_hf_tensors(bias=False, tied=True)
    ckpt = load_gguf(write_tiny_gguf(tmp_path / "llama.gguf", "llama", hf, Q.Q8_0), torch.float32)
    q = "model.layers.1.self_attn.q_proj.weight"
    np.testing.assert_allclose(ckpt.tensors[q].numpy(), hf[q], atol=0.05)


def test_a_slice_is_those_rows_or_columns_of_the_whole_unpermuted_tensor(tmp_path):
    """What a tensor-parallel rank loads: a head-aligned block of q rows, a
    block of o_proj columns, in the serving dtype."""
    hf = tiny_hf_tensors(bias=False, tied=True)
    source = GGUFSource(GGUFFile(write_tiny_gguf(tmp_path / "llama.gguf", "llama", hf, Q.Q8_0)),
                        torch.bfloat16, torch.device("cpu"))
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(source.get_slice(q, 0, 32, 64), source.get(q)[32:64])
    assert torch.equal(source.get_slice(o, 1, 0, 32), source.get(o)[:, :32])
    assert source.get_slice(q, 0, 32, 64).dtype == torch.bfloat16
    assert not source.has("lm_head.weight")


def test_llama_config_fields(tmp_path):
    hf = tiny_hf_tensors(bias=False, tied=True)
    config = load_gguf(write_tiny_gguf(tmp_path / "llama.gguf", "llama", hf), torch.float32).config
    assert config == {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": None,
        "attention_bias": False, "rope_scaling": None,
    }


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
def test_qwen2_with_biases_and_lm_head_is_not_permuted(tmp_path, qtype):
    hf = tiny_hf_tensors(bias=True, tied=False)
    path = write_tiny_gguf(tmp_path / "qwen2.gguf", "qwen2", hf, qtype, permute=False)
    ckpt = load_gguf(path, torch.float32)
    assert set(ckpt.tensors) == set(hf)
    for name, want in hf.items():
        np.testing.assert_array_equal(ckpt.tensors[name].numpy(), quantized(want, qtype), err_msg=name)
    assert ckpt.config["model_type"] == "qwen2"
    assert ckpt.config["architectures"] == ["Qwen2ForCausalLM"]
    assert ckpt.config["attention_bias"] is True
    assert ckpt.config["tie_word_embeddings"] is False


def test_tensors_come_in_the_requested_dtype(tmp_path):
    hf = tiny_hf_tensors(bias=False, tied=True)
    ckpt = load_gguf(write_tiny_gguf(tmp_path / "llama.gguf", "llama", hf, Q.Q8_0), torch.bfloat16)
    assert {t.dtype for t in ckpt.tensors.values()} == {torch.bfloat16}


def test_llama_file_of_a_mistral_model_is_mistral(tmp_path):
    hf = tiny_hf_tensors(bias=False, tied=True)
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", hf, name="Mistral 7B Instruct v0.3",
                           extra={"add_sliding_window": 4096})
    ckpt = load_gguf(path, torch.float32)
    assert ckpt.config["model_type"] == "mistral"
    assert ckpt.config["architectures"] == ["MistralForCausalLM"]
    assert ckpt.config["sliding_window"] == 4096
    k = "model.layers.0.self_attn.k_proj.weight"
    np.testing.assert_array_equal(ckpt.tensors[k].numpy(), hf[k])


def test_rope_scaling_keys_become_hf_rope_scaling(tmp_path):
    hf = tiny_hf_tensors(bias=False, tied=True)
    linear = write_tiny_gguf(tmp_path / "linear.gguf", "llama", hf, extra={
        "add_rope_scaling_type": gguf.RopeScalingType.LINEAR, "add_rope_scaling_factor": 4.0})
    qwen2 = tiny_hf_tensors(bias=True, tied=True)
    yarn = write_tiny_gguf(tmp_path / "yarn.gguf", "qwen2", qwen2, permute=False, extra={
        "add_rope_scaling_type": gguf.RopeScalingType.YARN, "add_rope_scaling_factor": 4.0,
        "add_rope_scaling_orig_ctx_len": 32768})
    assert load_gguf(linear, torch.float32).config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert load_gguf(yarn, torch.float32).config["rope_scaling"] == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def llama3_divisors(theta: float, head_dim: int, factor: float, low: float, high: float, original: int):
    """llama.cpp's rope_freqs for Llama 3 rope scaling, written out as its converter does."""
    divisors = []
    for inv_freq in theta ** -(np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * math.pi / inv_freq
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def test_llama3_rope_freqs_tensor_becomes_llama3_rope_scaling(tmp_path):
    # Tiny head_dim 16 and theta 100 put two frequencies in the ramp, so the fit is exercised
    # (Meta's defaults, original context 8192, would not match).
    divisors = llama3_divisors(100.0, TINY["head_dim"], factor=8.0, low=1.0, high=4.0, original=256)
    hf = tiny_hf_tensors(bias=False, tied=True)
    path = write_tiny_gguf(tmp_path / "llama3.gguf", "llama", hf, theta=100.0,
                           extra_tensors={"rope_freqs.weight": divisors})
    ckpt = load_gguf(path, torch.float32)
    assert "rope_freqs.weight" not in ckpt.tensors
    assert ckpt.config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


def test_unknown_rope_freqs_raise(tmp_path):
    hf = tiny_hf_tensors(bias=False, tied=True)
    divisors = np.linspace(1.0, 3.0, TINY["head_dim"] // 2, dtype=np.float32)
    path = write_tiny_gguf(tmp_path / "odd.gguf", "llama", hf, extra_tensors={"rope_freqs.weight": divisors})
    assert_one_line_error(lambda: load_gguf(path, torch.float32), "rope_freqs")


# ---------------------------------------------------------------- errors


def assert_one_line_error(call, *fragments):
    with pytest.raises(CheckpointError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and message
    for fragment in fragments:
        assert fragment in message
    return message


def test_missing_file_raises(tmp_path):
    assert_one_line_error(lambda: load_gguf(tmp_path / "absent.gguf", torch.float32), "not found")
    assert_one_line_error(lambda: load_gguf_tokenizer(tmp_path / "absent.gguf"), "not found")


@pytest.mark.parametrize("keep", [0.5, 0.01], ids=["in-tensor-data", "in-header"])
def test_truncated_file_raises(tmp_path, keep):
    path = write_tiny_gguf(tmp_path / "t.gguf", "llama", tiny_hf_tensors(bias=False, tied=True))
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    assert_one_line_error(lambda: load_gguf(path, torch.float32), str(path), "truncated")


def test_text_file_raises(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("this is not a model\nat all\n")
    assert_one_line_error(lambda: load_gguf(path, torch.float32), "not a valid GGUF")


def test_unsupported_architecture_raises_naming_the_supported_ones(tmp_path):
    path = write_tiny_gguf(tmp_path / "gpt2.gguf", "gpt2", tiny_hf_tensors(bias=False, tied=True))
    assert_one_line_error(lambda: load_gguf(path, torch.float32), "gpt2", "llama", "mistral", "qwen2")
    assert_one_line_error(lambda: load_gguf_tokenizer(path), "gpt2")


def test_missing_tensor_raises(tmp_path):
    hf = tiny_hf_tensors(bias=False, tied=True)
    del hf["model.layers.1.mlp.up_proj.weight"]
    path = write_tiny_gguf(tmp_path / "partial.gguf", "llama", hf)
    assert_one_line_error(lambda: load_gguf(path, torch.float32), "model.layers.1.mlp.up_proj.weight")


# ---------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2_checkpoint(smollm2_hf):
    return load_gguf(smollm2_hf[2], torch.float32)


def test_smollm2_config_is_smollm2_135m(smollm2_checkpoint):
    config = smollm2_checkpoint.config
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (576, 30, 1536)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in smollm2_checkpoint.tensors
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["max_position_embeddings"] == 8192 and config["rope_scaling"] is None


def test_smollm2_tokenizer_round_trips_and_has_the_chat_template(smollm2_hf):
    tokenizer = smollm2_hf[1]
    text = "Hello world! Ünïcode, numbers 12345 and   spaces."
    ids = tokenizer(text).input_ids
    assert ids[:2] == [19556, 905]  # "Hello", " world" in SmolLM2's vocabulary; no BOS is added
    assert tokenizer.decode(ids) == text
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_answers_in_english_so_q_k_are_unpermuted(smollm2_hf, smollm2_greedy):
    """transformers' model on the tensors load_gguf gave (smollm2_hf) knows
    the capital of France: rows still interleaved would garble it. The
    session's greedy tokens of that prompt, which test_engine_matches_hf
    compares ours with (the chat template is test_smollm2_tokenizer_...'s)."""
    tokenizer = smollm2_hf[1]
    answer = tokenizer.decode(smollm2_greedy("The capital of France is", 12), skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_smollm2_tensors_match_transformers_gguf_loader(smollm2_hf, smollm2_checkpoint, fast_gguf_reader):
    """On one torch thread: its ops are copies and elementwise compares, whose
    two OpenMP threads wait on each other beside other processes' work
    (shard_harness.torch_threads)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from ..shard_harness import torch_threads  # here: importing it costs seconds that this module's others need not

    with torch_threads(1):
        theirs = load_gguf_checkpoint(str(smollm2_hf[2]), return_tensors=True,
                                      model_to_load=smollm2_hf[0])["tensors"]
        assert set(theirs) == set(smollm2_checkpoint.tensors)
        for name, tensor in smollm2_checkpoint.tensors.items():
            torch.testing.assert_close(tensor, torch.as_tensor(theirs[name]), rtol=0, atol=1e-6, msg=name)


# ---------------------------------------------------------------- qwen3 and gemma

def _family_tensors(qk_norms: bool, gemma: bool) -> dict[str, np.ndarray]:
    """tiny_hf_tensors plus the family's own: q/k norms, gemma's two more norms."""
    hf = tiny_hf_tensors(bias=False, tied=True, seed=3)
    rng = np.random.default_rng(4)
    for layer in range(TINY["layers"]):
        p = f"model.layers.{layer}."
        extra = {}
        if qk_norms:
            extra.update({p + "self_attn.q_norm.weight": (TINY["head_dim"],),
                          p + "self_attn.k_norm.weight": (TINY["head_dim"],)})
        if gemma:
            extra.update({p + "pre_feedforward_layernorm.weight": (TINY["hidden"],),
                          p + "post_feedforward_layernorm.weight": (TINY["hidden"],)})
        hf.update({name: rng.standard_normal(shape).astype(np.float32) for name, shape in extra.items()})
    return hf


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3"])
def test_qwen3_and_gemma_tensors_round_trip(tmp_path, arch, monkeypatch):
    """Names as llama.cpp writes them (q/k norms; gemma's four norms a layer,
    ffn_norm its MLP's input), q/k rows not permuted, gemma's norms stored as
    1 + w and read back as that minus 1 in float32 (what transformers' GGUF
    loader reads); gemma2's soft caps from its metadata."""
    gemma = arch.startswith("gemma")
    hf = _family_tensors(qk_norms=arch != "gemma2", gemma=gemma)
    stored = {name: data + np.float32(1) if gemma and name.endswith("norm.weight") else data
              for name, data in hf.items()}
    if gemma:
        monkeypatch.setitem(GGUF_NAMES, "post_attention_layernorm", "post_attention_norm")
        monkeypatch.setitem(GGUF_NAMES, "pre_feedforward_layernorm", "ffn_norm")
        monkeypatch.setitem(GGUF_NAMES, "post_feedforward_layernorm", "post_ffw_norm")
    monkeypatch.setitem(GGUF_NAMES, "self_attn.q_norm", "attn_q_norm")
    monkeypatch.setitem(GGUF_NAMES, "self_attn.k_norm", "attn_k_norm")
    extra = {"add_key_length": TINY["head_dim"], "add_value_length": TINY["head_dim"]}
    if arch == "gemma2":
        extra.update(add_attn_logit_softcapping=50.0, add_final_logit_softcapping=30.0, add_sliding_window=4)
    ckpt = load_gguf(write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, stored, permute=False, extra=extra),
                     torch.float32)
    assert set(ckpt.tensors) == set(hf)
    for name, want in hf.items():
        read_as = stored[name] - np.float32(1) if stored[name] is not want else want
        np.testing.assert_array_equal(ckpt.tensors[name].numpy(), read_as, err_msg=name)
    expected_type = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text"}[arch]
    assert ckpt.config["model_type"] == expected_type
    if arch == "gemma2":
        assert (ckpt.config["attn_logit_softcapping"], ckpt.config["final_logit_softcapping"]) == (50.0, 30.0)
