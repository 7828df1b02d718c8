"""The models of issue 56's scale benchmark: random weights in the shapes of
Qwen2.5-0.5B and Llama-3.2-1B (layers, hidden and MLP sizes, heads, GQA,
tied embeddings, RoPE base), with SmolLM2's tokenizer (neither original
tokenizer is reachable here, so the vocabulary is SmolLM2's 49,152 tokens),
initialised at the originals' scale (normal, std 0.02). Speed does not
depend on the weights' values.

`build(name, folder)` writes, once (an existing file is kept):
- hf/: bf16 safetensors, config and tokenizer (for our server and vLLM);
- q4_0.gguf: every linear and the embedding in Q4_0;
- q4_k_m.gguf: llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for the tied
  embedding and for attn_v and ffn_down in the layers llama.cpp's
  `use_more_bits` picks; rows that do not split into 256-value blocks take
  its fallbacks (Q4_K -> Q5_0, Q6_K -> Q8_0), as Qwen2.5-0.5B's 896-wide
  rows do. Norms and biases stay float32.
Llama's Q and K rows are permuted to GGUF's interleaved RoPE order, as
llama.cpp's converter does. Not written: Llama 3's `rope_freqs` tensor (its
long-context frequency scaling), which changes no step's cost.

`python -m benchmarks.scale_models FOLDER [NAME ...]` builds them."""

import sys
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

from benchmarks.gguf_kquants import quantize_q4_k, quantize_q6_k
from tgi_server.weights.gguf_reader import FastGGUFReader

Q = gguf.GGMLQuantizationType
SHAPES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                         max_position_embeddings=32768, tie_word_embeddings=True),
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                        rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=True),
}
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}  # llama.cpp's, for rows not a multiple of 256
ENCODERS = {Q.Q4_K: quantize_q4_k, Q.Q6_K: quantize_q6_k}


def tokenizer_source() -> Path:
    from tgi_server.weights.resolve import default_model_path

    return default_model_path()


def build(name: str, folder: Path, shape: dict | None = None, seed: int = 0) -> Path:
    """folder/name with hf/, q4_0.gguf and q4_k_m.gguf (see the module's
    docstring); shape: SHAPES[name] unless given (tests build small ones)."""
    from tgi_server.weights.gguf import load_gguf_tokenizer

    out = Path(folder) / name
    hf = out / "hf"
    if not (hf / "config.json").exists():
        tokenizer = load_gguf_tokenizer(tokenizer_source())
        values = dict(shape or SHAPES[name])
        config = transformers.AutoConfig.for_model(
            values.pop("model_type"), vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, initializer_range=0.02, **values)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        model.save_pretrained(hf)
        tokenizer.save_pretrained(hf)
    for kind in ("q4_0", "q4_k_m"):
        if not (out / f"{kind}.gguf").exists():
            write_gguf(hf, out / f"{kind}.gguf", kind)
    return out


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's pick of the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(gguf_name: str, columns: int, kind: str, num_layers: int) -> Q:
    """The block type of a 2-D tensor in a `kind` file ("q4_0" or "q4_k_m")."""
    if kind == "q4_0":
        wanted = Q.Q4_0
    elif gguf_name == "token_embd.weight":  # tied: it is also the output, which Q4_K_M keeps in Q6_K
        wanted = Q.Q6_K
    elif gguf_name.endswith(("attn_v.weight", "ffn_down.weight")):
        wanted = Q.Q6_K if use_more_bits(int(gguf_name.split(".")[1]), num_layers) else Q.Q4_K
    else:
        wanted = Q.Q4_K
    block = gguf.GGML_QUANT_SIZES[wanted][0]
    return wanted if columns % block == 0 else FALLBACK[wanted]


def encode(weight: np.ndarray, kind: Q) -> np.ndarray:
    """weight [rows, columns] float32 -> its blocks, uint8 [rows, bytes]."""
    return ENCODERS[kind](weight) if kind in ENCODERS else gguf.quants.quantize(weight, kind)


def interleave_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """Q or K rows [heads * head_dim, K] from HF's half-split RoPE order to
    GGUF llama's interleaved one (llama.cpp's converter's permutation)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(hf: Path, path: Path, kind: str) -> None:
    """The hf/ checkpoint as a GGUF file of `kind`, with SmolLM2's tokenizer metadata."""
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(hf)
    arch = config.model_type  # "llama" or "qwen2": GGUF's architecture names too
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    tensors = {}
    for file in sorted(hf.glob("*.safetensors")):
        tensors.update({k: v.float().numpy() for k, v in load_file(file).items()})
    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    writer.add_name(path.parent.name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if kind == "q4_0" else gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    reader = FastGGUFReader(tokenizer_source())
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for hf_name, weight in tensors.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in name else config.num_key_value_heads
            weight = interleave_rope(weight, heads)
        if weight.ndim == 1:
            writer.add_tensor(name, weight)
        else:
            block_type = tensor_type(name, weight.shape[1], kind, config.num_hidden_layers)
            writer.add_tensor(name, encode(weight, block_type), raw_dtype=block_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(path)


if __name__ == "__main__":
    folder, names = Path(sys.argv[1]), sys.argv[2:] or list(SHAPES)
    for name in names:
        print(build(name, folder))
