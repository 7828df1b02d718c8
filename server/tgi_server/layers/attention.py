"""Paged self-attention over one ragged batch: decodes first, then prefills;
`HeadShard` is a tensor-parallel rank's share of the heads."""

from dataclasses import dataclass

import torch
from torch import nn

from tgi_kernels import (DecodeMeta, PrefillMeta, fuses_rotary, paged_decode, rotary_store_kv, store_kv,
                         varlen_prefill)

from ..distributed import TensorParallel
from ..weights.source import TensorSource
from .linear import Linear
from .rotary import apply_rotary


@dataclass(frozen=True)
class HeadShard:
    """One rank's attention heads: query heads [q_start, q_start + num_heads)
    and key-value heads [kv_start, kv_start + num_kv_heads) of the checkpoint.

    With fewer kv heads than ranks, each rank keeps the one kv head its query
    heads read (kv head h serves world_size / num_kv_heads consecutive ranks)."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int

    @classmethod
    def of_rank(cls, num_heads: int, num_kv_heads: int, tp: TensorParallel) -> "HeadShard":
        """Assumes ModelConfig.check_tensor_parallel passed for tp.world_size."""
        heads = num_heads // tp.world_size
        # Query head h reads kv head h * num_kv_heads // num_heads; for this
        # rank's first query head, rank * heads, that is:
        kv_start = tp.rank * num_kv_heads // tp.world_size
        return cls(heads, max(1, num_kv_heads // tp.world_size), tp.rank * heads, kv_start)


@dataclass(frozen=True)
class ForwardContext:
    """Everything a step's attention needs besides the hidden states.

    The flat batch holds `num_decode_tokens` decode tokens (one per decoding
    sequence) followed by the prefill chunks."""

    positions: torch.Tensor      # [T] int64 absolute position of each token
    slot_mapping: torch.Tensor   # [T] int64 cache slot of each token (block * block_size + offset)
    num_decode_tokens: int
    decode: DecodeMeta | None
    prefill: PrefillMeta | None
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [num_blocks, block_size, kv_heads, head_dim] each
    backend: str


class Attention(nn.Module):
    """x [T, hidden] -> [T, hidden]; writes the step's K/V into the layer's cache.

    num_heads / num_kv_heads are this rank's; its cache holds its kv heads only."""

    def __init__(self, qkv: Linear, o_proj: Linear, layer_idx: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, sliding_window: int):
        super().__init__()
        self.qkv, self.o_proj = qkv, o_proj
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sliding_window = sliding_window
        self.scale = head_dim ** -0.5

    @classmethod
    def load(cls, weights: TensorSource, prefix: str, layer_idx: int, heads: HeadShard, head_dim: int,
             sliding_window: int, bias: bool, tp: TensorParallel) -> "Attention":
        """This rank's heads: q/k/v column-parallel by head, o_proj row-parallel."""
        q_rows = (heads.q_start * head_dim, (heads.q_start + heads.num_heads) * head_dim)
        kv_rows = (heads.kv_start * head_dim, (heads.kv_start + heads.num_kv_heads) * head_dim)
        qkv = Linear.load_column(weights, [(f"{prefix}.q_proj", *q_rows), (f"{prefix}.k_proj", *kv_rows),
                                           (f"{prefix}.v_proj", *kv_rows)], bias)
        o_proj = Linear.load_row(weights, f"{prefix}.o_proj", heads.num_heads * head_dim * tp.world_size,
                                 bias=False, tp=tp)
        return cls(qkv, o_proj, layer_idx, heads.num_heads, heads.num_kv_heads, head_dim, sliding_window)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden], cos/sin [T, 1, head_dim] (see RotaryEmbedding) -> [T, hidden]."""
        tokens = x.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv(x).view(tokens, heads + 2 * kv_heads, self.head_dim)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        if fuses_rotary(ctx.backend):
            qkv = qkv.contiguous()  # a no-op after a GEMM; rotated in place
            rotary_store_kv(qkv, cos, sin, heads, k_cache, v_cache, ctx.slot_mapping)
            q = qkv[:, :heads]
            k = None  # sliced below only where a prefill reads it
        else:
            # q and k rotate together: [T, heads + kv_heads, head_dim]
            qk = apply_rotary(qkv[:, :heads + kv_heads], cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            store_kv(k, qkv[:, heads + kv_heads:], k_cache, v_cache, ctx.slot_mapping, ctx.backend)

        nd = ctx.num_decode_tokens
        if ctx.prefill is None:  # every token decodes: no slicing (~2.5 us a view, 30 layers a step)
            out = paged_decode(q, k_cache, v_cache, ctx.decode, self.scale, self.sliding_window, ctx.backend)
        else:
            k = qkv[:, heads:heads + kv_heads] if k is None else k
            v = qkv[:, heads + kv_heads:]
            out = varlen_prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, ctx.prefill, self.scale,
                                 self.sliding_window, ctx.backend)
            if ctx.decode is not None:
                decoded = paged_decode(q[:nd], k_cache, v_cache, ctx.decode, self.scale, self.sliding_window,
                                       ctx.backend)
                out = torch.cat([decoded, out], dim=0)  # [T, heads, head_dim]
        return self.o_proj(out.reshape(tokens, heads * self.head_dim))
