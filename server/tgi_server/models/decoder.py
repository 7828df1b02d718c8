"""The decoder families (llama, mistral, qwen2, qwen3, smollm3, phi3,
gemma2, gemma3 text, and with sparse mixture-of-experts MLPs mixtral,
qwen2_moe, qwen3_moe) on one flattened ragged batch.

They differ only in facts of ModelConfig (models/families.py says which each
sets): sliding windows and RoPE tables per layer (and layers without RoPE,
or RoPE on part of each head), fused qkv and gate_up tensors, q/k/v biases,
q/k norms, which layers route tokens to experts, Gemma's 1 + weight norms,
norms after attention and after the MLP, GELU-tanh, scaled embeddings, the
attention scale, soft caps on the attention scores and on the logits, tied
embeddings. Under tensor parallelism each layer loads this rank's slice; the
model code only says which layers split by output (column) and which by
input (row)."""

import torch
from torch import nn

from ..distributed import TensorParallel
from ..layers.attention import Attention, ForwardContext, HeadShard
from ..layers.embedding import Embedding, LMHead
from ..layers.mlp import GatedMLP
from ..layers.moe import SparseMoE
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from ..weights.source import TensorSource
from .config import ModelConfig


def _norm(weights: TensorSource, name: str, config: ModelConfig) -> RMSNorm:
    return RMSNorm.load(weights, name, config.rms_norm_eps, config.norm_offset)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; with sandwich norms (gemma) each
    block's output is normed too before it joins the residual stream. The
    checkpoint's names: llama calls the MLP's input norm
    post_attention_layernorm, gemma calls it pre_feedforward_layernorm and
    uses post_attention_layernorm on the attention's output."""

    def __init__(self, weights: TensorSource, prefix: str, layer_idx: int, config: ModelConfig,
                 heads: HeadShard, tp: TensorParallel):
        super().__init__()
        facts = config.layers[layer_idx]
        self.input_layernorm = _norm(weights, f"{prefix}.input_layernorm", config)
        self.self_attn = Attention.load(weights, f"{prefix}.self_attn", layer_idx, heads, config, tp)
        self.rope = facts.rope
        if config.sandwich_norms:
            self.attn_out_norm = _norm(weights, f"{prefix}.post_attention_layernorm", config)
            self.mlp_in_norm = _norm(weights, f"{prefix}.pre_feedforward_layernorm", config)
            self.mlp_out_norm = _norm(weights, f"{prefix}.post_feedforward_layernorm", config)
        else:
            self.attn_out_norm = self.mlp_out_norm = None
            self.mlp_in_norm = _norm(weights, f"{prefix}.post_attention_layernorm", config)
        if facts.sparse:
            moe = config.moe
            self.mlp = SparseMoE.load(weights, f"{prefix}.{moe.block}", moe, config.hidden_act, tp)
        else:
            names = "gate_up_proj" if config.fused_gate_up else ("gate_proj", "up_proj", "down_proj")
            self.mlp = GatedMLP.load(weights, f"{prefix}.mlp", names, config.intermediate_size, config.mlp_bias,
                                     config.hidden_act, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                rotations: list[tuple[torch.Tensor, torch.Tensor]], ctx: ForwardContext
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (x', residual'), each [T, hidden]: the residual
        stream is residual + x, kept apart so that each add is fused into the
        norm after it. The first layer gets residual None (x is the stream);
        residual is updated in place. rotations: (cos, sin) of each RoPE table."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm.add_forward(x, residual)
        cos_sin = rotations[self.rope] if self.rope >= 0 else None
        h = self.self_attn(h, cos_sin, ctx)
        if self.attn_out_norm is not None:
            h = self.attn_out_norm(h)
        h = self.mlp(self.mlp_in_norm.add_forward(h, residual))
        if self.mlp_out_norm is not None:
            h = self.mlp_out_norm(h)
        return h, residual


class DecoderForCausalLM(nn.Module):
    """ids [T] + ForwardContext -> hidden [T, hidden]; `logits` maps chosen
    rows of the hidden states to float32 logits [S, vocab].

    Holds tp's rank's slice of the weights; `heads` are that rank's attention
    heads (its KV cache holds heads.num_kv_heads)."""

    def __init__(self, weights: TensorSource, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.config = config
        self.heads = HeadShard.of_rank(config.num_heads, config.num_kv_heads, tp)
        self.embed_tokens = Embedding.load(weights, "model.embed_tokens", config.vocab_size, tp, config.embed_scale)
        self.layers = nn.ModuleList(
            DecoderLayer(weights, f"model.layers.{i}", i, config, self.heads, tp) for i in range(config.num_layers))
        self.norm = _norm(weights, "model.norm", config)
        tied = config.tie_word_embeddings or not weights.has("lm_head.weight")
        self.lm_head = LMHead.load(weights, "lm_head", config.vocab_size, tp, self.embed_tokens if tied else None,
                                   config.final_logit_softcap)
        self.rotary = [RotaryEmbedding(torch.tensor(rope.inv_freq, dtype=torch.float32, device=weights.device),
                                       rope.attention_scaling) for rope in config.ropes]

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden], a fresh tensor: the residual stream may own it
        # (cos, sin) [T, 1, head_dim] each, per RoPE table
        rotations = [rotary.cos_sin(ctx.positions, x.dtype) for rotary in self.rotary]
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rotations, ctx)
        return residual + x

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """hidden [T, hidden], rows [S] int64 (None: every row) -> logits [S, vocab] float32.
        The final norm is per token, so it runs on the chosen rows only."""
        return self.lm_head(self.final_hidden(hidden, rows))

    def final_hidden(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The chosen rows [S, hidden] after the final norm: what the LM head
        (and Medusa heads) read."""
        return self.norm(hidden if rows is None else hidden.index_select(0, rows))
