"""Rotary position embeddings (rotate-half convention of Hugging Face Llama).

Inverse frequencies come from transformers' own RoPE initialisers, so every
scaling type a config.json can name (linear, dynamic, yarn, llama3, longrope)
matches the reference implementation; cos/sin are computed once per step for
the step's positions and shared by all layers."""

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def rope_parameters(config: PretrainedConfig, head_dim: int,
                    layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] float32, attention scaling) for the config's RoPE
    type; layer_type: the table of that layer type, for configs whose
    rope_parameters hold one per type (gemma3)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = rotary_dim(config, head_dim)
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, "
                         + ", ".join(sorted(ROPE_INIT_FUNCTIONS)))
    # "dynamic" keeps its initial frequencies: Hugging Face only grows the NTK
    # base past max_position_embeddings, which we never serve.
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scaling)


def rotary_dim(config: PretrainedConfig, head_dim: int) -> int:
    """How many leading dims of each head RoPE rotates (phi3's
    partial_rotary_factor < 1 leaves the rest as they are)."""
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_type" not in params:  # none, or one table per layer type (gemma3: never partial)
        params = {}
    return int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))


class RotaryEmbedding:
    """cos/sin tables for arbitrary positions: positions [T] -> ([T, D], [T, D])."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float):
        self.inv_freq = inv_freq  # [D/2] float32
        self.attention_scaling = attention_scaling

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos [T, 1, D], signed sin [T, 1, D]) for apply_rotary.

        The sine's first half is negated so that rotate_half(x) * sin equals
        roll(x, D/2) * signed_sin: one roll instead of a neg and a cat."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos = (torch.cat((freqs, freqs), dim=-1).cos() * self.attention_scaling).to(dtype)
        sin = freqs.sin() * self.attention_scaling
        signed_sin = torch.cat((-sin, sin), dim=-1).to(dtype)
        return cos[:, None, :], signed_sin[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/signed_sin [T, 1, D] -> rotated x [T, heads, D]
    (Hugging Face's x * cos + rotate_half(x) * sin)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
