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
`sequential_pass` runs a layer stage by stage, rounding q/k/v, o_proj,
gate/up and down_proj in turn on inputs through those already rounded
(float32); q/k/v share q_proj's inputs and gate/up share gate_proj's."""

import ast
import sysconfig
from collections.abc import Callable
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


def calibration_ids(model, tokenizer, num_sequences: int, length: int, seed: int,
                    source: str | Path = "stdlib") -> torch.Tensor:
    """[num_sequences, length] token ids: windows of the text `source` names
    ("stdlib", or a file path) tokenized, or with "generated" sequences the
    model samples (temperature 1, top-k 50) from BOS (needed when there is
    no tokenizer)."""
    if source != "generated" and tokenizer is not None:
        text = stdlib_text(num_sequences * length * 6) if source == "stdlib" else Path(source).read_text()
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        windows = ids[: len(ids) // length * length].reshape(-1, length)
        if len(windows) == 0:
            raise ValueError(f"{source}: fewer than {length} tokens")
        return windows[:num_sequences]
    bos = model.config.bos_token_id if model.config.bos_token_id is not None else 0
    torch.manual_seed(seed)
    start = torch.full((num_sequences, 1), bos, dtype=torch.long)
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


def sequential_pass(layer, chunks: list[tuple[torch.Tensor, dict]],
                    round_group: Callable[[str, torch.Tensor], None]) -> list[tuple[torch.Tensor, dict]]:
    """Runs a Llama-family decoder layer over the chunks and, at the input of
    each INPUT_GROUPS linear in forward order, calls round_group(key,
    hessian [K, K] = X^T X / n over the chunks' inputs, float32), which
    rounds that group's linears in place; returns the chunks' outputs of the
    rounded layer, what it feeds the next.

    Each stage keeps what the next needs, so each GEMM and the attention run
    once per token (four forwards of the layer cut short at a hook did the
    same with about twice the compute). The ops are the layer's own, in its
    order: the outputs are the bits layer(hidden, **kwargs) gives."""
    attn, mlp = layer.self_attn, layer.mlp
    with torch.no_grad():
        x = [layer.input_layernorm(hidden) for hidden, _ in chunks]  # [c, L, D] each
        round_group("self_attn.q_proj", _hessian(x))
        a = _o_proj_inputs(attn, x, [kwargs for _, kwargs in chunks])  # [c, L, heads * head_dim]
        round_group("self_attn.o_proj", _hessian(a))
        residual = [hidden + attn.o_proj(ai) for ai, (hidden, _) in zip(a, chunks)]
        x = [layer.post_attention_layernorm(r) for r in residual]
        round_group("mlp.gate_proj", _hessian(x))
        m = [mlp.act_fn(mlp.gate_proj(xi)) * mlp.up_proj(xi) for xi in x]  # [c, L, intermediate]
        round_group("mlp.down_proj", _hessian(m))
        return [(r + mlp.down_proj(mi), kwargs) for r, mi, (_, kwargs) in zip(residual, m, chunks)]


def _hessian(inputs: list[torch.Tensor]) -> torch.Tensor:
    """X^T X / n [K, K] float32 over the rows of all inputs [..., K], summed chunk by chunk."""
    total, count = 0, 0
    for x in inputs:
        x = x.reshape(-1, x.shape[-1]).float()  # [c * L, K]
        total, count = total + x.T @ x, count + x.shape[0]
    return total / count


def _o_proj_inputs(attn, inputs: list[torch.Tensor], kwargs: list[dict]) -> list[torch.Tensor]:
    """The attention's outputs before o_proj, one per chunk (the forward stops there)."""
    caught = []

    def catch(module, args):
        caught.append(args[0])
        raise _Stop

    handle = attn.o_proj.register_forward_pre_hook(catch)
    try:
        for x, kw in zip(inputs, kwargs):
            try:
                attn(hidden_states=x, **kw)
            except _Stop:
                pass
    finally:
        handle.remove()
    return caught


def sample_inputs(layer, chunks: list[tuple[torch.Tensor, dict]], names: list[str], max_rows: int,
                  seed: int) -> dict[str, torch.Tensor]:
    """About max_rows rows [~max_rows, K] float32 of the inputs of `layer`'s
    linears `names` (INPUT_GROUPS keys, in forward order) over all chunks,
    drawn at random in proportion to each chunk's tokens (AWQ's search). The
    pass stops at the last of them."""
    captured_inputs, generator = {}, torch.Generator().manual_seed(seed)
    total = sum(hidden.shape[0] * hidden.shape[1] for hidden, _ in chunks)

    def hook(name):
        def catch(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()  # [c * L, K]
            rows = max(1, max_rows * x.shape[0] // total)
            picked = x[torch.randperm(x.shape[0], generator=generator)[:rows]]
            captured_inputs[name] = (torch.cat([captured_inputs[name], picked]) if name in captured_inputs
                                     else picked)
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
    return captured_inputs


def submodule(layer, name: str):
    owner, attr = name.split(".")
    return getattr(getattr(layer, owner), attr)
