"""The Llama family (llama, mistral, qwen2) on one flattened ragged batch.

The three differ only in facts of ModelConfig: sliding windows (mistral,
qwen2 when enabled), q/k/v biases (qwen2), tied embeddings, RoPE scaling.
Under tensor parallelism each layer loads this rank's slice; the model code
only says which layers split by output (column) and which by input (row)."""

import torch
from torch import nn

from ..distributed import TensorParallel
from ..layers.activation import silu_mul
from ..layers.attention import Attention, ForwardContext, HeadShard
from ..layers.embedding import Embedding, LMHead
from ..layers.linear import Linear
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from ..weights.source import TensorSource
from .config import ModelConfig


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate and up share one GEMM.

    Each rank holds its share of the intermediate size (gate/up column-parallel,
    down row-parallel)."""

    def __init__(self, gate_up: Linear, down: Linear):
        super().__init__()
        self.gate_up, self.down = gate_up, down

    @classmethod
    def load(cls, weights: TensorSource, prefix: str, config: ModelConfig, tp: TensorParallel) -> "MLP":
        start, stop = tp.split(config.intermediate_size)
        gate_up = Linear.load_column(
            weights, [(f"{prefix}.gate_proj", start, stop), (f"{prefix}.up_proj", start, stop)], config.mlp_bias)
        down = Linear.load_row(weights, f"{prefix}.down_proj", config.intermediate_size, config.mlp_bias, tp)
        return cls(gate_up, down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(silu_mul(self.gate_up(x)))  # gate_up: [T, 2 I / world_size]


class DecoderLayer(nn.Module):
    def __init__(self, weights: TensorSource, prefix: str, layer_idx: int, config: ModelConfig,
                 heads: HeadShard, tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm.load(weights, f"{prefix}.input_layernorm", config.rms_norm_eps)
        self.self_attn = Attention.load(
            weights, f"{prefix}.self_attn", layer_idx, heads, config.head_dim,
            config.sliding_windows[layer_idx], config.attention_bias, tp)
        self.post_attention_layernorm = RMSNorm.load(
            weights, f"{prefix}.post_attention_layernorm", config.rms_norm_eps)
        self.mlp = MLP.load(weights, f"{prefix}.mlp", config, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (x', residual'), each [T, hidden]: the residual
        stream is residual + x, kept apart so that each add is fused into the
        norm after it. The first layer gets residual None (x is the stream);
        residual is updated in place."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm.add_forward(x, residual)
        h = self.post_attention_layernorm.add_forward(self.self_attn(h, cos, sin, ctx), residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """ids [T] + ForwardContext -> hidden [T, hidden]; `logits` maps chosen
    rows of the hidden states to float32 logits [S, vocab].

    Holds tp's rank's slice of the weights; `heads` are that rank's attention
    heads (its KV cache holds heads.num_kv_heads)."""

    def __init__(self, weights: TensorSource, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.config = config
        self.heads = HeadShard.of_rank(config.num_heads, config.num_kv_heads, tp)
        self.embed_tokens = Embedding.load(weights, "model.embed_tokens", config.vocab_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(weights, f"model.layers.{i}", i, config, self.heads, tp) for i in range(config.num_layers))
        self.norm = RMSNorm.load(weights, "model.norm", config.rms_norm_eps)
        tied = config.tie_word_embeddings or not weights.has("lm_head.weight")
        self.lm_head = LMHead.load(weights, "lm_head", config.vocab_size, tp, self.embed_tokens if tied else None)
        self.rotary = RotaryEmbedding(
            torch.tensor(config.rope_inv_freq, dtype=torch.float32, device=weights.device),
            config.rope_attention_scaling)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden], a fresh tensor: the residual stream may own it
        cos, sin = self.rotary.cos_sin(ctx.positions, x.dtype)  # [T, head_dim] each
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        return residual + x

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden], rows [S] int64 -> logits [S, vocab] float32.
        The final norm is per token, so it runs on the chosen rows only."""
        return self.lm_head(self.norm(hidden.index_select(0, rows)))
