"""A GGUF file's metadata as the config.json that transformers would read
for its model: sizes, RoPE (and its scaling), windows, soft caps, experts.
Keys are llama.cpp's (`<architecture>.<key>`); tensor shapes fill in what
its converter leaves out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader

from .errors import CheckpointError
from .gguf_chat import FALLBACKS
from .gguf_rope import llama3_scaling

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen2moe",
                           "qwen3moe")
# GGUF architecture -> transformers model_type, where they differ
_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
              "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
              "qwen3_moe": "Qwen3MoeForCausalLM"}
# llama.cpp keeps Llama 3's rope scaling as this tensor of per-frequency
# divisors, and phi3's longrope as two tensors of factors.
ROPE_FREQS = "rope_freqs.weight"
ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")


def gguf_config(reader: GGUFReader, arch: str, shapes: dict[str, tuple[int, ...]], path: Path) -> dict:
    """config.json's fields for the file's model (`shapes`: GGUF tensor
    name -> numpy shape); CheckpointError when metadata we need is missing."""
    def key(name, default=None):
        return field(reader, f"{arch}.{name}", default)

    for required in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"):
        if key(required) is None:
            raise CheckpointError(f"{path}: GGUF metadata lacks {arch}.{required}")
    if "token_embd.weight" not in shapes:
        raise CheckpointError(f"{path}: GGUF file lacks token_embd.weight")
    hidden, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    q_rows = shapes.get("blk.0.attn_q.weight", (hidden,))[0]  # phi3 fuses q, k and v: a head is hidden / heads
    head_dim = int(key("attention.key_length", q_rows // n_heads))
    model_type = _MODEL_TYPES.get(arch, arch)
    if arch == "llama" and key("expert_count"):
        model_type = "mixtral"  # llama.cpp converts Mixtral models to the llama architecture, with experts
    elif arch == "llama" and "mistral" in str(field(reader, "general.name", "")).lower():
        model_type = "mistral"  # ... and Mistral models too
    rope_theta = float32(key("rope.freq_base", 10000.0))
    window = key("attention.sliding_window")
    layers = int(key("block_count"))
    config = {
        "model_type": model_type,
        "architectures": [HF_CLASSES[model_type]],
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(reader, arch),
        "sliding_window": None if window is None else int(window),
        "attention_bias": arch in ("qwen2", "qwen2moe") or "blk.0.attn_q.bias" in shapes,
        "rope_scaling": _rope_scaling(reader, arch, rope_theta, head_dim, path),
    }
    for key_name in ("attn_logit_softcapping", "final_logit_softcapping"):  # gemma2's, as llama.cpp writes them
        if key(key_name) is not None:
            config[key_name] = float32(key(key_name))
    if arch == "phi3":
        config.update(_phi3(reader, head_dim, path))
    if model_type in ("mixtral", "qwen2_moe", "qwen3_moe"):
        config.update(_experts(key, model_type, layers, shapes))
    return config


def _phi3(reader: GGUFReader, head_dim: int, path: Path) -> dict:
    """RoPE on the first rope.dimension_count dims of a head (Phi-4-mini
    rotates 3/4 of each), and longrope: its short and long factor tensors."""
    def key(name, default=None):
        return field(reader, f"phi3.{name}", default)

    rotary = int(key("rope.dimension_count", head_dim))
    config = {"partial_rotary_factor": rotary / head_dim,
              "original_max_position_embeddings": int(key("rope.scaling.original_context_length",
                                                          key("context_length", 2048)))}
    factors = {t.name: [float32(f) for f in np.asarray(t.data)] for t in reader.tensors if t.name in ROPE_FACTORS}
    if not factors:
        return config
    if len(factors) != 2 or any(len(f) != rotary // 2 for f in factors.values()):
        raise CheckpointError(f"{path}: phi3 rope factors must be two tensors of {rotary // 2} values")
    scaling = {"rope_type": "longrope", "short_factor": factors[ROPE_FACTORS[0]],
               "long_factor": factors[ROPE_FACTORS[1]]}
    if key("rope.scaling.attn_factor") is not None:
        scaling["attention_factor"] = float32(key("rope.scaling.attn_factor"))
    return config | {"rope_scaling": scaling}


def _experts(key, model_type: str, layers: int, shapes: dict[str, tuple[int, ...]]) -> dict:
    """Expert counts and sizes. Every layer routes (llama.cpp's qwen2moe and
    qwen3moe have no dense MLP layers); qwen3moe renormalizes its top-k
    weights and qwen2moe does not, as llama.cpp computes them."""
    count = int(key("expert_count", 0))
    used = int(key("expert_used_count", 0))
    if model_type == "mixtral":
        return {"num_local_experts": count, "num_experts_per_tok": used}
    gate = shapes.get("blk.0.ffn_gate_exps.weight", (0, 0))
    config = {"num_experts": count, "num_experts_per_tok": used,
              "moe_intermediate_size": int(key("expert_feed_forward_length", gate[1])),
              "norm_topk_prob": model_type == "qwen3_moe", "decoder_sparse_step": 1, "mlp_only_layers": []}
    if model_type == "qwen2_moe":
        shared = shapes.get("blk.0.ffn_gate_shexp.weight", (0,))
        config["shared_expert_intermediate_size"] = int(key("expert_shared_feed_forward_length", shared[0]))
    return config


def _eos_ids(reader: GGUFReader, arch: str) -> int | list[int] | None:
    """The file's end-of-sequence id, and for families in gguf_chat.FALLBACKS
    the id of the token that ends a turn, when the vocabulary has it."""
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if arch not in FALLBACKS or tokens is None:
        return eos
    end_of_turn = FALLBACKS[arch][1].encode()
    # field.data indexes the parts holding each token's bytes (no list of 262k strings built)
    turn = next((i for i, part in enumerate(tokens.data) if bytes(tokens.parts[part]) == end_of_turn), None)
    return eos if turn is None or turn == eos else [i for i in (eos, turn) if i is not None]


def _rope_scaling(reader: GGUFReader, arch: str, theta: float, head_dim: int, path: Path) -> dict | None:
    def key(name, default=None):
        return field(reader, f"{arch}.rope.{name}", default)

    kind = key("scaling.type", "linear" if key("scale_linear") else "none")
    factor = float32(key("scaling.factor", key("scale_linear", 1.0)))
    if kind == "none" or (kind == "linear" and factor == 1.0):
        freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
        if freqs is None:
            return None
        return llama3_scaling(np.asarray(freqs.data, np.float64), theta, head_dim, path)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor}
        extra = {
            "original_max_position_embeddings": ("scaling.original_context_length", int),
            "attention_factor": ("scaling.attn_factor", float32),
            "beta_fast": ("scaling.yarn_beta_fast", float32),
            "beta_slow": ("scaling.yarn_beta_slow", float32),
        }
        for hf_key, (gguf_key, cast) in extra.items():
            if key(gguf_key) is not None:
                scaling[hf_key] = cast(key(gguf_key))
        return scaling
    raise CheckpointError(f"{path}: unsupported rope scaling type {kind!r} (supported: linear, yarn)")


def field(reader: GGUFReader, key: str, default=None):
    """Metadata `key`'s value, or `default` when the file lacks it."""
    found = reader.fields.get(key)
    return default if found is None else found.contents()


def float32(value) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))
