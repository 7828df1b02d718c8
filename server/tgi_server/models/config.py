"""The facts our model code needs, read once from a transformers config."""

from dataclasses import dataclass

from transformers import PretrainedConfig

from ..layers.rotary import rope_parameters
from ..weights.errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool       # q/k/v biases (qwen2)
    mlp_bias: bool
    sliding_windows: tuple[int, ...]  # per layer; 0 = full attention
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_inv_freq: tuple[float, ...]  # [head_dim/2] float32 values
    rope_attention_scaling: float

    @classmethod
    def from_hf(cls, hf: PretrainedConfig) -> "ModelConfig":
        model_type = getattr(hf, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(f"unsupported architecture {model_type!r}; supported: "
                                  + ", ".join(SUPPORTED_MODEL_TYPES))
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise CheckpointError(f"unsupported activation {hf.hidden_act!r}; supported: silu")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        try:
            inv_freq, scaling = rope_parameters(hf, head_dim)
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"invalid RoPE configuration: {err}") from None
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            sliding_windows=_sliding_windows(hf),
            max_position_embeddings=hf.max_position_embeddings,
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
            rope_inv_freq=tuple(inv_freq.tolist()),
            rope_attention_scaling=scaling,
        )


    def check_tensor_parallel(self, world_size: int) -> None:
        """ValueError, naming the numbers, unless the model splits over
        `world_size` shards: each rank takes an equal share of the attention
        heads and of the MLP's intermediate size; key-value heads are split
        too, or, when fewer than the shards, each is replicated on
        world_size / num_kv_heads consecutive ranks."""
        if world_size == 1:
            return
        if self.num_heads % world_size:
            raise ValueError(f"cannot shard {self.num_heads} attention heads over {world_size} shards")
        if self.num_kv_heads % world_size and world_size % self.num_kv_heads:
            raise ValueError(f"cannot shard {self.num_kv_heads} key-value heads over {world_size} shards "
                             f"(the shard count must divide them or be a multiple of them)")
        if self.intermediate_size % world_size:
            raise ValueError(f"cannot shard an intermediate size of {self.intermediate_size} "
                             f"over {world_size} shards")


def _sliding_windows(hf: PretrainedConfig) -> tuple[int, ...]:
    """Mistral windows every layer; Qwen2 names its windowed layers in
    `layer_types` (only when use_sliding_window); Llama never windows."""
    window = getattr(hf, "sliding_window", None) or 0
    layer_types = getattr(hf, "layer_types", None)
    if hf.model_type == "llama" or not window:
        return (0,) * hf.num_hidden_layers
    if layer_types:
        return tuple(window if t == "sliding_attention" else 0 for t in layer_types)
    return (window,) * hf.num_hidden_layers
