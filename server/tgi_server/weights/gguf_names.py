"""GGUF tensor names in Hugging Face terms, and the shapes the HF model expects.

llama.cpp names a layer's tensors `blk.N.<kind>`; most map one to one onto
an HF parameter. A mixture-of-experts layer stores each projection of all
its experts as one 3-D tensor ([experts, rows, columns] in numpy order),
which is HF's `experts.E.<projection>` for every E: rows [E * rows,
(E + 1) * rows) of the tensor viewed as 2-D. phi3 keeps HF's fused qkv_proj
(attn_qkv) and gate_up_proj (ffn_up) as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_QWEN_MOE_NAMES = {**_LAYER_NAMES, "ffn_gate_inp": "mlp.gate",
                   "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                   "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
# Per model_type: GGUF kind -> HF module of a layer, and (for MoE) the experts'
# module and GGUF expert kind -> HF projection.
LAYER_NAMES = {
    # Gemma's four norms a layer: ffn_norm is the MLP's input norm, as in
    # llama, but transformers calls it pre_feedforward_layernorm there.
    "gemma2": {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "mixtral": {**_LAYER_NAMES, "ffn_gate_inp": "block_sparse_moe.gate"},
    "qwen2_moe": _QWEN_MOE_NAMES,
    "qwen3_moe": _QWEN_MOE_NAMES,
}
LAYER_NAMES["gemma3_text"] = LAYER_NAMES["gemma2"]
_EXPERTS = {
    "mixtral": ("block_sparse_moe.experts", {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}),
    "qwen2_moe": ("mlp.experts", {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                                  "ffn_down_exps": "down_proj"}),
}
_EXPERTS["qwen3_moe"] = _EXPERTS["qwen2_moe"]
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class Part:
    """Where an HF tensor lies in a GGUF file.

    gguf: the GGUF tensor's name; kind: its kind (attn_q, ffn_up_exps, ...);
    rows: (start, stop) of the GGUF tensor viewed as 2-D [rows, columns], or
    None for all of it; shape: the HF tensor's shape."""

    gguf: str
    kind: str
    rows: tuple[int, int] | None
    shape: tuple[int, ...]


def hf_parts(name: str, shape: tuple[int, ...], model_type: str, path: Path) -> dict[str, Part]:
    """HF name -> Part for every HF tensor that GGUF tensor `name` (numpy
    `shape`) holds; CheckpointError for a tensor we cannot serve."""
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL_NAMES and suffix == "weight":
        return {f"{_GLOBAL_NAMES[stem]}.weight": Part(name, stem, None, shape)}
    match = _LAYER_TENSOR.fullmatch(name)
    if match:
        layer, kind, suffix = match.groups()
        experts, projections = _EXPERTS.get(model_type, ("", {}))
        if kind in projections and suffix == "weight" and len(shape) == 3:
            count, rows = shape[0], shape[1]
            return {f"model.layers.{layer}.{experts}.{e}.{projections[kind]}.weight":
                    Part(name, kind, (e * rows, (e + 1) * rows), shape[1:]) for e in range(count)}
        names = LAYER_NAMES.get(model_type, _LAYER_NAMES)
        if kind in names:
            if kind == "ffn_gate_inp_shexp":  # HF's [1, hidden]; llama.cpp may store [hidden]
                shape = (1, shape[-1])
            return {f"model.layers.{layer}.{names[kind]}.{suffix}": Part(name, kind, None, shape)}
    raise CheckpointError(f"{path}: unsupported tensor {name} in this GGUF file")


def check_shapes(shapes: dict[str, tuple[int, ...]], config: dict, path: Path) -> None:
    """Every tensor the HF model of `config` (gguf_config's dict) needs is
    present with the HF shape (`shapes`: HF name -> shape), and no other."""
    expected = {"model.embed_tokens.weight": (config["vocab_size"], config["hidden_size"]),
                "model.norm.weight": (config["hidden_size"],)}
    if not config["tie_word_embeddings"]:
        expected["lm_head.weight"] = (config["vocab_size"], config["hidden_size"])
    sparse = sparse_layers(config)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        expected.update({prefix + name: shape for name, shape in _layer_shapes(config, layer in sparse).items()})
    for name, shape in expected.items():
        if name not in shapes:
            raise CheckpointError(f"{path}: tensor {name} is missing from the GGUF file")
        if shapes[name] != shape:
            raise CheckpointError(f"{path}: tensor {name} has shape {shapes[name]}, expected {shape}")
    extra = sorted(name for name in set(shapes) - set(expected) if not name.endswith(".bias"))
    if extra:
        raise CheckpointError(f"{path}: unexpected tensor {extra[0]} in the GGUF file")


def sparse_layers(config: dict) -> set[int]:
    """The layers of `config` (gguf_config's dict) that route to experts."""
    layers = range(config["num_hidden_layers"])
    if config["model_type"] == "mixtral":
        return set(layers)
    if config["model_type"] in ("qwen2_moe", "qwen3_moe"):
        return set(layers) - set(config["mlp_only_layers"])
    return set()


def _layer_shapes(config: dict, sparse: bool) -> dict[str, tuple[int, ...]]:
    model_type, hidden, dim = config["model_type"], config["hidden_size"], config["head_dim"]
    q_rows, kv_rows = config["num_attention_heads"] * dim, config["num_key_value_heads"] * dim
    shapes = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
              "self_attn.o_proj.weight": (hidden, q_rows)}
    if model_type == "phi3":
        shapes["self_attn.qkv_proj.weight"] = (q_rows + 2 * kv_rows, hidden)
    else:
        shapes.update({"self_attn.q_proj.weight": (q_rows, hidden), "self_attn.k_proj.weight": (kv_rows, hidden),
                       "self_attn.v_proj.weight": (kv_rows, hidden)})
    if config["attention_bias"]:
        shapes.update({"self_attn.q_proj.bias": (q_rows,), "self_attn.k_proj.bias": (kv_rows,),
                       "self_attn.v_proj.bias": (kv_rows,)})
    if model_type in ("qwen3", "gemma3_text", "qwen3_moe"):
        shapes.update({"self_attn.q_norm.weight": (dim,), "self_attn.k_norm.weight": (dim,)})
    if model_type in ("gemma2", "gemma3_text"):
        shapes.update({"pre_feedforward_layernorm.weight": (hidden,), "post_feedforward_layernorm.weight": (hidden,)})
    if not sparse:
        inter = config["intermediate_size"]
        if model_type == "phi3":
            return shapes | {"mlp.gate_up_proj.weight": (2 * inter, hidden), "mlp.down_proj.weight": (hidden, inter)}
        return shapes | _gated("mlp", ("gate_proj", "up_proj", "down_proj"), inter, hidden)
    experts, projections = _EXPERTS[model_type]
    names = tuple(projections[kind] for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    count = config.get("num_local_experts") or config["num_experts"]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    shapes[experts.rpartition(".")[0] + ".gate.weight"] = (count, hidden)
    for e in range(count):
        shapes |= _gated(f"{experts}.{e}", names, inter, hidden)
    if config.get("shared_expert_intermediate_size"):
        shapes |= _gated("mlp.shared_expert", ("gate_proj", "up_proj", "down_proj"),
                         config["shared_expert_intermediate_size"], hidden)
        shapes["mlp.shared_expert_gate.weight"] = (1, hidden)
    return shapes


def _gated(prefix: str, names: tuple[str, str, str], inter: int, hidden: int) -> dict[str, tuple[int, ...]]:
    gate, up, down = names
    return {f"{prefix}.{gate}.weight": (inter, hidden), f"{prefix}.{up}.weight": (inter, hidden),
            f"{prefix}.{down}.weight": (hidden, inter)}
