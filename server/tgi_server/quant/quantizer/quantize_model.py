"""`quantize_model`: a float checkpoint (HF directory or GGUF file) in, a
GPTQ or AWQ checkpoint out (see export.py for the layouts)."""

from pathlib import Path

import torch
import transformers

from ...weights.resolve import resolve_model
from ...weights.tokenizer_export import has_tokenizer_files
from ..quantized_matrix import QuantizedMatrix
from .awq_search import search_scales
from .calibration import INPUT_GROUPS, calibration_ids, first_layer_inputs, sample_inputs, sequential_pass, submodule
from .export import save_quantized
from .gptq_solver import gptq_quantize

# Families whose decoder layer is calibration.sequential_pass's: a pre-norm
# attention and a pre-norm gated MLP of gate_proj / up_proj / down_proj.
QUANTIZABLE = ("llama", "mistral", "qwen2", "qwen3")


def quantize_model(model_id: str | None, out: Path, method: str, bits: int = 4, group_size: int = 128,
                   act_order: bool = False, symmetric: bool = False, calibration_sequences: int = 64, length: int = 128,
                   seed: int = 0, calibration: str | Path = "stdlib", loaded: tuple | None = None) -> None:
    """Quantize every decoder linear of `model_id` (None: the default model)
    with GPTQ (`bits` 4 or 8, symmetric or not, optional act-order) or AWQ
    (4 bits, asymmetric, searched scales) and write the checkpoint to `out`.
    calibration: "stdlib", "generated" or a text file (calibration.py).
    loaded: load_float_model(model_id)'s (model, tokenizer) already in
    memory, used instead of loading it again; its weights are changed.

    Layer by layer, and within a layer q/k/v, o, gate/up, down in turn, each
    is rounded by GPTQ on the inputs the already-quantized model feeds it.
    AWQ first folds its scales into the float layer, then rounds the same
    way: its layout only fixes the grid, not how values are picked, and
    GPTQ's error feedback is worth ~5 points of perplexity over rounding to
    nearest on SmolLM2-135M."""
    if method == "awq" and (bits != 4 or act_order or symmetric):
        raise ValueError("AWQ writes asymmetric 4-bit checkpoints without act-order")
    model, tokenizer = loaded or load_float_model(model_id)
    if model.config.model_type not in QUANTIZABLE:
        raise ValueError(f"the quantizer follows the decoder layers of {', '.join(QUANTIZABLE)}, not "
                         f"{model.config.model_type}'s (norms after attention, fused or routed MLPs)")
    ids = calibration_ids(model, tokenizer, calibration_sequences, length, seed, calibration)
    chunks = first_layer_inputs(model, ids)
    matrices: dict[str, QuantizedMatrix] = {}
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        if method == "awq":  # scales from the float layer's inputs, folded in before any rounding
            _awq_rescale(layer, sample_inputs(layer, chunks, list(INPUT_GROUPS), 1024, seed + i), group_size)

        def round_group(caught: str, h: torch.Tensor, *, layer=layer, prefix=prefix) -> None:
            # h [K, K]: inputs through this layer's linears already quantized (true-sequential).
            linears = [submodule(layer, name) for name in INPUT_GROUPS[caught]]
            # GPTQ treats rows independently given H: linears sharing inputs go through it together.
            # AWQ's layout has no g_idx; act-order's static groups keep it the plain one.
            stacked = gptq_quantize(torch.cat([m.weight.detach() for m in linears]), h, bits, group_size,
                                    act_order or method == "awq", symmetric)
            bounds = torch.tensor([0] + [m.weight.shape[0] for m in linears]).cumsum(0).tolist()
            for name, m, (a, b) in zip(INPUT_GROUPS[caught], linears, zip(bounds, bounds[1:])):
                matrices[f"{prefix}.{name}"] = part = stacked.rows(slice(a, b))
                with torch.no_grad():
                    m.weight.copy_(part.dequantize())

        chunks = sequential_pass(layer, chunks, round_group)
    save_quantized(model, matrices, out, method, group_size, act_order, symmetric, tokenizer)


def _awq_rescale(layer, captured_inputs: dict[str, torch.Tensor], group_size: int) -> None:
    """Folds AWQ's searched factors into the layer: q/k/v and gate/up columns
    times s, their norm divided by s; down columns times s, up rows divided
    by s. (o_proj's input comes from v through attention; folding needs v's
    rows to match o's columns, so, as AutoAWQ does with grouped KV heads, it
    is left unscaled unless they match.)"""
    attn, mlp = layer.self_attn, layer.mlp
    pairs = [("self_attn.q_proj", layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj]),
             ("mlp.gate_proj", layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj]),
             ("mlp.down_proj", mlp.up_proj, [mlp.down_proj])]
    if attn.v_proj.weight.shape[0] == attn.o_proj.weight.shape[1]:
        pairs.append(("self_attn.o_proj", attn.v_proj, [attn.o_proj]))
    with torch.no_grad():
        for caught, previous, linears in pairs:
            x = captured_inputs[caught]
            s = search_scales(x, [m.weight for m in linears], group_size)  # [K]
            for m in linears:
                m.weight.mul_(s)
            if previous.weight.dim() == 1:  # a norm's weight
                previous.weight.div_(s)
            else:                           # a linear's output rows
                previous.weight.div_(s[:, None])
                if getattr(previous, "bias", None) is not None:
                    previous.bias.div_(s)


def save_float_model(model_id: str | None, out: Path, dtype: torch.dtype = torch.bfloat16,
                     loaded: tuple | None = None) -> None:
    """`model_id` (a GGUF file too, dequantized) as a plain safetensors
    directory in `dtype`: the full-precision side of comparisons. loaded:
    as quantize_model's (the model is converted to `dtype` in place)."""
    model, tokenizer = loaded or load_float_model(model_id)
    model.to(dtype).save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def load_float_model(model_id: str | None):
    """(transformers model in float32, its tokenizer or None); a GGUF file
    (the default model's too) is dequantized."""
    source = resolve_model(model_id)
    if source.format == "gguf":
        from transformers.initialization import no_init_weights

        from ...weights.gguf import load_gguf, load_gguf_tokenizer

        checkpoint = load_gguf(source.path, torch.float32)
        values = dict(checkpoint.config)
        config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
        with no_init_weights():  # every weight is loaded below: random init took ~2 s for SmolLM2
            model = transformers.AutoModelForCausalLM.from_config(config)
        missing, unexpected = model.load_state_dict(checkpoint.tensors, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise ValueError(f"{source.path}: tensors the model lacks {sorted(unexpected)[:3]} "
                             f"or lacks {sorted(set(missing) - {'lm_head.weight'})[:3]}")
        model.tie_weights()
        return model.eval(), load_gguf_tokenizer(source.path)
    model = transformers.AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    if not has_tokenizer_files(source):
        return model, None  # a tokenizer-less checkpoint still calibrates on generated ids
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(source.path)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer
