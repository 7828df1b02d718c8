"""Calibration data for the quantizers and the layer inputs they need.

No dataset is downloaded. The text is, by choice: a given file; the
docstrings of Python's standard library ("stdlib", the default: English prose
shipped with every Python, read without importing anything); or text the
model generates itself from BOS ("generated"; sampled text is narrow, so
GPTQ needs many samples of it). GPTQ needs several thousand tokens: with
~1,000, its Hessian of SmolLM2's 1536-wide down_proj is singular and the
result is worse than rounding. Inputs are caught with forward pre-hooks on each decoder
layer's q_proj, o_proj, gate_proj and down_proj in one float32 pass over the
full-precision model; q/k/v share q_proj's inputs and gate/up share
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


@dataclass
class LayerInputs:
    """Per caught input `model.layers.{i}.{name}`: hessian [K, K] = X^T X / n
    (for GPTQ) or a sample of rows X [<= max_rows, K] (for AWQ)."""

    hessians: dict[str, torch.Tensor] = field(default_factory=dict)
    samples: dict[str, torch.Tensor] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)


def collect_inputs(model, ids: torch.Tensor, hessians: bool, max_rows: int = 1024) -> LayerInputs:
    """One forward pass over `ids` [S, L] with hooks on every decoder layer."""
    caught = LayerInputs()
    rows_per_batch = max(1, max_rows // ids.shape[0])

    def hook(name):
        def catch(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()  # [S_b * L, K]
            if hessians:
                caught.hessians[name] = caught.hessians.get(name, 0) + x.T @ x
                caught.counts[name] = caught.counts.get(name, 0) + x.shape[0]
            else:
                picked = x[torch.randperm(x.shape[0])[:rows_per_batch]]
                caught.samples[name] = torch.cat([caught.samples[name], picked]) if name in caught.samples else picked
        return catch

    handles = [module.register_forward_pre_hook(hook(f"model.layers.{i}.{name}"))
               for i, layer in enumerate(model.model.layers) for name, module in _caught(layer)]
    try:
        with torch.no_grad():
            for row in ids:
                model(row[None])
    finally:
        for handle in handles:
            handle.remove()
    for name, count in caught.counts.items():
        caught.hessians[name] /= count
    return caught


def _caught(layer):
    for name in INPUT_GROUPS:
        owner, attr = name.split(".")
        yield name, getattr(getattr(layer, owner), attr)
