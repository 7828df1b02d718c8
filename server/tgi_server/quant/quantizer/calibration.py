"""Calibration data for the quantizers and the layer inputs they need.

No dataset is downloaded. The text is, by choice: a given file; the
docstrings of Python's standard library ("stdlib", the default: English prose
shipped with every Python, read without importing anything); or text the
model generates itself from BOS ("generated"; sampled text is narrow, so
GPTQ needs many samples of it). GPTQ needs several thousand tokens: with
~1,000, its Hessian of SmolLM2's 1536-wide down_proj is singular and the
result is worse than rounding.

Calibration is sequential (GPTQ paper; AutoGPTQ's true-sequential): layer
i's inputs come from running the calibration batch through layers 0..i-1
already quantized, so each layer corrects for the error of those before it.
Inputs are caught with forward pre-hooks on q_proj, o_proj, gate_proj and
down_proj (float32); q/k/v share q_proj's inputs and gate/up share
gate_proj's."""

import ast
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The linears whose inputs are caught, and the linears that share them.
INPUT_GROUPS = {"self_attn.q_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "self_attn.o_proj": ("self_attn.o_proj",),
                "mlp.gate_proj": ("mlp.gate_proj", "mlp.up_proj"),
                "mlp.down_proj": ("mlp.down_proj",)}


def stdlib_text(chars: int) -> str:
    """About `chars` characters of docstrings from Python's standard library
    (modules in sorted order, so the text is the same on every run)."""
    parts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    parts.append(doc)
                    total += len(doc)
        if total >= chars:
            break
    return "\n\n".join(parts)


def calibration_ids(model, tokenizer, samples: int, length: int, seed: int,
                    source: str | Path = "stdlib") -> torch.Tensor:
    """[samples, length] token ids: windows of the text `source` names
    ("stdlib", or a file path) tokenized, or with "generated" sequences the
    model samples (temperature 1, top-k 50) from BOS (needed when there is
    no tokenizer)."""
    if source != "generated" and tokenizer is not None:
        text = stdlib_text(samples * length * 6) if source == "stdlib" else Path(source).read_text()
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        windows = ids[: len(ids) // length * length].reshape(-1, length)
        if len(windows) == 0:
            raise ValueError(f"{source}: fewer than {length} tokens")
        return windows[:samples]
    bos = model.config.bos_token_id if model.config.bos_token_id is not None else 0
    torch.manual_seed(seed)
    start = torch.full((samples, 1), bos, dtype=torch.long)
    with torch.no_grad():
        out = model.generate(start, attention_mask=torch.ones_like(start), do_sample=True, top_k=50,
                             max_new_tokens=length - 1, min_new_tokens=length - 1, pad_token_id=bos)
    return out[:, :length]


CHUNK = 16  # calibration sequences run through a decoder layer at once (bounds activation memory)


class _Stop(Exception):
    """Raised from a hook to end a forward pass once what it needs is caught."""


def first_layer_inputs(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, dict]]:
    """ids [S, L] -> per chunk of CHUNK sequences: (hidden [c, L, D] entering
    decoder layer 0, the keyword arguments the model passes every layer:
    mask, positions, rotary embeddings)."""
    layer, chunks = model.model.layers[0], []

    def catch(module, args, kwargs):
        chunks.append((args[0].detach(), kwargs))
        raise _Stop

    handle = layer.register_forward_pre_hook(catch, with_kwargs=True)
    try:
        with torch.no_grad():
            for batch in ids.split(CHUNK):
                try:
                    model.model(batch, use_cache=False)
                except _Stop:
                    pass
    finally:
        handle.remove()
    return chunks


def run_layer(layer, chunks: list[tuple[torch.Tensor, dict]]) -> list[tuple[torch.Tensor, dict]]:
    """The chunks' hidden states after `layer` (as it is now: quantized layers
    feed the next layer what the quantized model will)."""
    with torch.no_grad():
        outputs = [layer(hidden, **kwargs) for hidden, kwargs in chunks]
    return [(out[0] if isinstance(out, tuple) else out, kwargs) for out, (_, kwargs) in zip(outputs, chunks)]


@dataclass
class LayerInputs:
    """Per caught input (an INPUT_GROUPS key): hessian [K, K] = X^T X / n
    (for GPTQ) or a sample of rows X [~max_rows, K] (for AWQ's search)."""

    hessians: dict[str, torch.Tensor] = field(default_factory=dict)
    samples: dict[str, torch.Tensor] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)


def catch_inputs(layer, chunks: list[tuple[torch.Tensor, dict]], names: list[str], max_rows: int = 0,
                 seed: int = 0) -> LayerInputs:
    """The inputs of `layer`'s linears `names` (INPUT_GROUPS keys, in forward
    order) over all chunks: hessians, or with max_rows > 0 (AWQ's search)
    a sample of about that many rows instead. The pass stops at the last of them."""
    caught, generator = LayerInputs(), torch.Generator().manual_seed(seed)
    total = sum(hidden.shape[0] * hidden.shape[1] for hidden, _ in chunks)

    def hook(name):
        def catch(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()  # [c * L, K]
            if not max_rows:
                caught.hessians[name] = caught.hessians.get(name, 0) + x.T @ x
                caught.counts[name] = caught.counts.get(name, 0) + x.shape[0]
            else:
                rows = max(1, max_rows * x.shape[0] // total)
                picked = x[torch.randperm(x.shape[0], generator=generator)[:rows]]
                caught.samples[name] = torch.cat([caught.samples[name], picked]) if name in caught.samples else picked
            if name == names[-1]:
                raise _Stop
        return catch

    handles = [submodule(layer, name).register_forward_pre_hook(hook(name)) for name in names]
    try:
        with torch.no_grad():
            for hidden, kwargs in chunks:
                try:
                    layer(hidden, **kwargs)
                except _Stop:
                    pass
    finally:
        for handle in handles:
            handle.remove()
    for name, count in caught.counts.items():
        caught.hessians[name] /= count
    return caught


def submodule(layer, name: str):
    owner, attr = name.split(".")
    return getattr(getattr(layer, owner), attr)
