"""Medusa heads: drafts from the target's own last hidden state.

A Medusa checkpoint (as TGI reads one) is a directory whose config.json
has `medusa_num_heads` and `medusa_num_layers` (and `base_model_name_or_path`
when the base model's weights live elsewhere), beside
`medusa_lm_head.safetensors`: head i is `medusa_num_layers` residual blocks
x + silu(W x + b) (tensors `{i}.{j}.linear.weight` / `.bias`) and an output
projection to the vocabulary (`{i}.{medusa_num_layers}.weight`), applied to
the hidden state the LM head reads (after the final norm).

The row of the LM head that sampled a sequence's last token predicts that
token; head i, on the same row, the token i + 1 places after it. So each
step keeps, per sequence that sampled, the normed hidden states of its
sampling rows, and the next step drafts from the row of the last token kept
(known on every rank once the kept tokens are shared): the argmax of heads
0..k-1. Heads are replicated on every rank, which all read the same normed
hidden state and so draft alike."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from ..weights.source import MEDUSA_HEADS_FILE as HEADS_FILE


def medusa_config(path: Path) -> dict | None:
    """The Medusa fields of a model directory's config.json, or None when it
    has no Medusa heads."""
    config = path / "config.json"
    if not path.is_dir() or not config.is_file() or not (path / HEADS_FILE).is_file():
        return None
    fields = json.loads(config.read_text())
    return fields if "medusa_num_heads" in fields else None


class MedusaHeads(nn.Module):
    """heads(x [S, hidden]) -> drafts [S, num_heads] int64: each head's argmax
    (within the first vocab_size ids, the target's vocabulary)."""

    def __init__(self, path: Path, config: dict, vocab_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        tensors = load_file(str(path / HEADS_FILE), device=str(device))
        self.num_heads = int(config["medusa_num_heads"])
        self.num_layers = int(config.get("medusa_num_layers", 1))
        self.vocab_size = vocab_size
        for i in range(self.num_heads):
            if f"{i}.{self.num_layers}.weight" not in tensors:
                raise ValueError(f"{path / HEADS_FILE} lacks head {i}'s output projection "
                                 f"({i}.{self.num_layers}.weight)")
        # [heads, layers, hidden, hidden] / [heads, layers, hidden] / [heads, vocab, hidden]
        self.weights = nn.Parameter(torch.stack([torch.stack([tensors[f"{i}.{j}.linear.weight"]
                                                              for j in range(self.num_layers)])
                                                 for i in range(self.num_heads)]).to(dtype), requires_grad=False) \
            if self.num_layers else None
        self.biases = nn.Parameter(torch.stack([torch.stack([tensors[f"{i}.{j}.linear.bias"]
                                                             for j in range(self.num_layers)])
                                                for i in range(self.num_heads)]).to(dtype), requires_grad=False) \
            if self.num_layers else None
        self.out = nn.Parameter(torch.stack([tensors[f"{i}.{self.num_layers}.weight"][:vocab_size]
                                             for i in range(self.num_heads)]).to(dtype), requires_grad=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.out.dtype).unsqueeze(0).expand(self.num_heads, -1, -1)  # [H, S, hidden]
        for j in range(self.num_layers):
            # x + silu(x W^T + b), every head at once: [H, S, hidden]
            x = x + torch.nn.functional.silu(torch.baddbmm(self.biases[:, j].unsqueeze(1), x,
                                                           self.weights[:, j].transpose(1, 2)))
        logits = torch.bmm(x, self.out.transpose(1, 2))  # [H, S, vocab]
        return logits.argmax(dim=-1).transpose(0, 1)  # [S, H]
