"""Medusa heads for the default model, trained here for the speculation
benchmark (none are published for SmolLM2-135M-Instruct).

Medusa-1 training, small: the model stays frozen; head i (one residual block
x + silu(W x + b), W and b from zero, then the LM head's own weights, also
frozen) learns to predict the token i + 2 places after each position from
the final normed hidden state there, by cross-entropy over TRAIN_STEPS
batches of positions of English prose: the Python reference's topics
(pydoc_data.topics), far from the benchmark's tasks. (Heads trained on
standard library source instead drafted 1 right token in 39 on the copy
task.) The heads are written as TGI reads them:
config.json with medusa_num_heads, medusa_num_layers and
base_model_name_or_path (the default model's GGUF file), beside
medusa_lm_head.safetensors; once per machine, in the kernels' cache."""

import json
import textwrap
from pathlib import Path

import torch
from safetensors.torch import save_file

from tgi_kernels.native import cache_root

HEADS = 3
CORPUS_TOKENS = 24_000
CHUNK = 512
TRAIN_STEPS = 300
BATCH = 256
LR = 3e-3


def medusa_dir() -> Path:
    """The heads' directory, trained first if missing."""
    out = cache_root() / "medusa" / f"smollm2-135m-{HEADS}heads-{TRAIN_STEPS}-prose"
    if not (out / "medusa_lm_head.safetensors").is_file():
        train(out)
    return out


def _corpus(tokenizer) -> torch.Tensor:
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[name] for name in sorted(topics))
    return torch.tensor(tokenizer(text)["input_ids"][:CORPUS_TOKENS])


@torch.no_grad()
def _hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """The final normed hidden state [N, hidden] of every position, CHUNK tokens at a time."""
    out = []
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start:start + CHUNK].unsqueeze(0)
        out.append(model(chunk, output_hidden_states=True).hidden_states[-1][0])
    return torch.cat(out)


def train(out: Path) -> None:
    from tgi_server.quant.quantizer import load_float_model
    from tgi_server.weights.resolve import default_model_path

    torch.manual_seed(0)
    model, tokenizer = load_float_model(None)
    ids = _corpus(tokenizer)
    hidden = _hidden(model, ids)  # [N, H]; position t's row predicts token t + 1 through the LM head
    lm_head = model.lm_head.weight.detach()  # [V, H]
    size = hidden.shape[1]
    tensors = {}
    for head in range(HEADS):
        shift = head + 2  # head i predicts the token i + 2 places after the position
        x, y = hidden[:-shift], ids[shift:]
        w = torch.zeros(size, size, requires_grad=True)
        b = torch.zeros(size, requires_grad=True)
        opt = torch.optim.Adam([w, b], lr=LR)
        for _ in range(TRAIN_STEPS):
            pick = torch.randint(0, len(x), (BATCH,))
            h = x[pick]
            logits = (h + torch.nn.functional.silu(h @ w.T + b)) @ lm_head.T
            loss = torch.nn.functional.cross_entropy(logits, y[pick])
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"Medusa head {head}: loss {loss.item():.2f} after {TRAIN_STEPS} steps", flush=True)
        tensors.update({f"{head}.0.linear.weight": w.detach().to(torch.bfloat16),
                        f"{head}.0.linear.bias": b.detach().to(torch.bfloat16),
                        f"{head}.1.weight": lm_head.to(torch.bfloat16)})
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "medusa_lm_head.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "medusa_num_heads": HEADS, "medusa_num_layers": 1, "base_model_name_or_path": str(default_model_path()),
        "note": textwrap.shorten(__doc__, 200)}, indent=1))
