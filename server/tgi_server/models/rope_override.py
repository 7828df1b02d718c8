"""--rope-scaling / --rope-factor: a RoPE scaling that replaces the
checkpoint's, as TGI's ROPE_SCALING / ROPE_FACTOR do, and the longer
context it buys."""

from transformers import PretrainedConfig

from ..weights.errors import CheckpointError


def override_rope(hf: PretrainedConfig, scaling: str, factor: float) -> int:
    """Replace `hf`'s RoPE scaling by `scaling` at `factor` (in place);
    returns the model's length with it: max_position_embeddings x factor.

    linear and yarn become transformers' rope types of those names (yarn
    from the checkpoint's length as its original one). dynamic NTK grows
    the RoPE base with the sequence in transformers, per forward pass, which
    keys already rotated in a paged cache cannot follow; as vLLM does, the
    base is fixed at what transformers computes for the longest sequence
    served (max_position_embeddings x factor), the same for every token.
    CheckpointError for a model whose layers read RoPE tables of their own
    (gemma3's per-layer-type tables)."""
    params = getattr(hf, "rope_parameters", None) or {}
    if params and "rope_type" not in params:
        raise CheckpointError(f"--rope-scaling applies to one RoPE table; {hf.model_type} has one per "
                              f"layer type ({', '.join(sorted(params))})")
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    original = hf.max_position_embeddings
    served = int(original * factor)
    new = {"rope_type": scaling, "rope_theta": theta, "factor": factor}
    if "partial_rotary_factor" in params:
        new["partial_rotary_factor"] = params["partial_rotary_factor"]
    if scaling == "yarn":
        new["original_max_position_embeddings"] = original
    if scaling == "dynamic":
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        dim = int(head_dim * new.get("partial_rotary_factor", 1.0))
        # transformers' _compute_dynamic_ntk_parameters at seq_len = served
        new.pop("factor")
        base = theta * (factor * served / original - (factor - 1)) ** (dim / (dim - 2))
        new.update(rope_type="default", rope_theta=base)
    hf.rope_parameters = new
    return max(served, 1)
