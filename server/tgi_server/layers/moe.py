"""Sparse mixture-of-experts MLP block (mixtral, qwen2_moe, qwen3_moe).

A router scores the experts of each token; the token's hidden state goes
through its top-k experts and their outputs are summed, weighted by the
router's probabilities (renormalized over the k, or not, as the family
says). qwen2_moe adds a shared expert that every token takes, gated by a
sigmoid. Tokens are grouped by expert: one gate_up GEMM and one down GEMM
per expert that the batch touches, never a loop over tokens.

Under tensor parallelism every rank holds its slice of every expert's
intermediate size (as TGI does); the router is whole on every rank, so
every rank routes alike; the experts' row-parallel outputs are summed over
the ranks once, for the whole block."""

import torch
from torch import nn
from torch.nn import functional as F

from ..distributed import TensorParallel
from ..weights.source import TensorSource
from .linear import Linear
from .mlp import GatedMLP


class SparseMoE(nn.Module):
    """x [T, hidden] -> [T, hidden]."""

    def __init__(self, router: torch.Tensor, experts: list[GatedMLP], top_k: int, renormalize: bool,
                 shared: GatedMLP | None, shared_gate: Linear | None, tp: TensorParallel):
        super().__init__()
        self.router = nn.Parameter(router, requires_grad=False)  # [experts, hidden]
        self.experts = nn.ModuleList(experts)
        self.top_k, self.renormalize = top_k, renormalize
        self.shared, self.shared_gate = shared, shared_gate
        self.tp = tp

    @classmethod
    def load(cls, weights: TensorSource, prefix: str, moe, act: str, tp: TensorParallel) -> "SparseMoE":
        """moe: the model's MoEFacts (models/config.py); prefix: the block's
        name in the checkpoint (model.layers.N.mlp or .block_sparse_moe)."""
        experts = [GatedMLP.load(weights, f"{prefix}.experts.{e}", moe.expert_names, moe.intermediate_size,
                                 False, act, tp, reduce=False) for e in range(moe.num_experts)]
        shared = shared_gate = None
        if moe.shared_intermediate_size:
            shared = GatedMLP.load(weights, f"{prefix}.shared_expert", ("gate_proj", "up_proj", "down_proj"),
                                   moe.shared_intermediate_size, False, act, tp, reduce=False)
            shared_gate = Linear(weights.get(f"{prefix}.shared_expert_gate.weight"), None)  # [1, hidden]
        return cls(weights.get(f"{prefix}.gate.weight"), experts, moe.top_k, moe.renormalize,
                   shared, shared_gate, tp)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, expert ids [T, k]):
        softmax in float32 over all experts, then the top k."""
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)  # [T, experts]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        # The T x k (token, expert) pairs sorted by expert: expert e's are
        # the counts[e] after those of experts < e; pair p is token p // k.
        flat = ids.flatten()                                  # [T k]
        order = torch.argsort(flat, stable=True)              # [T k]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k                          # [T k] token of each sorted pair
        pair_weights = weights.flatten()[order]               # [T k]
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                rows = tokens[start:start + count]            # [count]
                y = expert(x.index_select(0, rows))           # [count, hidden], this rank's partial sum
                out.index_add_(0, rows, y * pair_weights[start:start + count, None])
            start += count
        if self.shared is not None:
            out += torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return self.tp.all_reduce_sum(out)
