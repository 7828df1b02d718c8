"""What each `model_type` sets in ModelConfig: its activations, its
windows, its RoPE tables and which layer reads which, its experts and which
layers route to them, and the mechanisms it adds (q/k norms, Gemma's norms
and scales). models/config.py reads these;
the decoder only ever sees the resulting facts."""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

from ..layers.rotary import rope_parameters
from .facts import MoEFacts

# transformers' activation names -> the decoder's
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _windows(hf: PretrainedConfig) -> tuple[int, ...]:
    """Per-layer sliding windows (0 = full attention). Mistral windows every
    layer; qwen2/qwen3/smollm3/gemma2/gemma3 name their windowed layers in
    `layer_types` (qwen2/3 and smollm3 only with use_sliding_window)."""
    window = getattr(hf, "sliding_window", None) or 0
    if hf.model_type == "llama" or not window or getattr(hf, "use_sliding_window", True) is False:
        return (0,) * hf.num_hidden_layers
    layer_types = getattr(hf, "layer_types", None)
    if layer_types:
        return tuple(window if t == "sliding_attention" else 0 for t in layer_types)
    return (window,) * hf.num_hidden_layers


Ropes = tuple[list[tuple[torch.Tensor, float]], tuple[int, ...]]


def _one_rope(hf: PretrainedConfig, head_dim: int) -> Ropes:
    """One table that every layer reads."""
    return [rope_parameters(hf, head_dim)], (0,) * hf.num_hidden_layers


def _smollm3_ropes(hf: PretrainedConfig, head_dim: int) -> Ropes:
    """`no_rope_layers[i]` is 1 where layer i applies RoPE, 0 where it does not."""
    uses = getattr(hf, "no_rope_layers", None) or [1] * hf.num_hidden_layers
    return [rope_parameters(hf, head_dim)], tuple(0 if use else -1 for use in uses)


def _per_layer_type_ropes(hf: PretrainedConfig, head_dim: int) -> Ropes:
    """A table per layer type (gemma3: local layers at base 10,000, global
    ones at their own base and scaling), each layer reading its type's."""
    types = sorted(set(hf.layer_types))
    tables = [rope_parameters(hf, head_dim, t) for t in types]
    return tables, tuple(types.index(t) for t in hf.layer_types)


def _qk_norms(hf: PretrainedConfig, head_dim: int) -> dict:
    """qwen3 and qwen3_moe: an RMSNorm over each head of q and of k."""
    return {"qk_norm": True}


def _gemma(hf: PretrainedConfig, head_dim: int) -> dict:
    """Gemma 2 and 3: 1 + w norms, sandwich norms, scaled embeddings, their
    own attention scale, a soft cap on the logits if set; gemma2 caps the
    attention scores too (gemma3's config field is there, unused, as in
    transformers), gemma3 norms q and k."""
    facts = dict(norm_offset=True, sandwich_norms=True, embed_scale=hf.hidden_size ** 0.5,
                 attn_scale=hf.query_pre_attn_scalar ** -0.5,
                 final_logit_softcap=getattr(hf, "final_logit_softcapping", None))
    if hf.model_type == "gemma2":
        facts["attn_softcap"] = float(getattr(hf, "attn_logit_softcapping", None) or 0.0)
    else:
        facts["qk_norm"] = True
    return facts


def _mixtral_moe(hf: PretrainedConfig) -> tuple[MoEFacts, tuple[bool, ...]]:
    moe = MoEFacts(hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size, True, 0,
                   "block_sparse_moe", ("w1", "w3", "w2"))
    return moe, (True,) * hf.num_hidden_layers


def _qwen_moe(hf: PretrainedConfig) -> tuple[MoEFacts, tuple[bool, ...]]:
    """qwen2_moe / qwen3_moe: a layer routes to experts unless it is in
    mlp_only_layers or off the decoder_sparse_step grid (transformers' rule)."""
    experts = getattr(hf, "num_experts", None) or hf.num_local_experts
    moe = MoEFacts(experts, hf.num_experts_per_tok, hf.moe_intermediate_size, bool(hf.norm_topk_prob),
                   getattr(hf, "shared_expert_intermediate_size", 0) or 0, "mlp",
                   ("gate_proj", "up_proj", "down_proj"))
    only = set(getattr(hf, "mlp_only_layers", None) or ())
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    return moe, tuple(i not in only and experts > 0 and (i + 1) % step == 0 for i in range(hf.num_hidden_layers))


@dataclass(frozen=True)
class Family:
    activations: tuple[str, ...] = ("silu",)
    qkv_bias: bool = False   # q/k/v biases whatever attention_bias says (qwen2)
    windows: Callable[[PretrainedConfig], tuple[int, ...]] = _windows
    ropes: Callable[[PretrainedConfig, int], Ropes] = _one_rope
    extras: Callable[[PretrainedConfig, int], dict] = field(default=lambda hf, head_dim: {})
    moe: Callable[[PretrainedConfig], tuple] | None = None  # (MoEFacts, which layers are sparse)


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(extras=_qk_norms),
    "smollm3": Family(ropes=_smollm3_ropes),
    "phi3": Family(extras=lambda hf, head_dim: {"fused_qkv": True, "fused_gate_up": True}),
    "mixtral": Family(moe=_mixtral_moe),
    "qwen2_moe": Family(qkv_bias=True, moe=_qwen_moe),
    "qwen3_moe": Family(extras=_qk_norms, moe=_qwen_moe),
    "gemma2": Family(activations=("gelu_pytorch_tanh",), extras=_gemma),
    "gemma3_text": Family(activations=("gelu_pytorch_tanh",), ropes=_per_layer_type_ropes, extras=_gemma),
}
