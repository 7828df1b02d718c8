"""Per-layer and per-block facts of a model, as ModelConfig holds them."""

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeTable:
    inv_freq: tuple[float, ...]  # [head_dim/2] float32 values
    attention_scaling: float     # cos and sin are multiplied by it (YaRN, longrope)


@dataclass(frozen=True)
class LayerFacts:
    sliding_window: int   # 0 = full attention
    rope: int             # index into ModelConfig.ropes; -1: this layer applies no RoPE
    sparse: bool = False  # its MLP is ModelConfig.moe's mixture of experts


@dataclass(frozen=True)
class MoEFacts:
    num_experts: int
    top_k: int
    intermediate_size: int                # each expert's
    renormalize: bool                     # the top k probabilities rescaled to sum to 1
    shared_intermediate_size: int         # 0: no shared expert (qwen2_moe has one)
    block: str                            # the block's checkpoint name: "mlp" or "block_sparse_moe" (mixtral)
    expert_names: tuple[str, str, str]    # each expert's gate, up, down tensors
