"""Paged self-attention over one ragged batch: decodes first, then prefills;
`HeadShard` is a tensor-parallel rank's share of the heads."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tgi_kernels import (
    DecodeMeta,
    PrefillMeta,
    fuses_rotary,
    key_rotation,
    paged_decode,
    rotary_store_kv,
    store_kv,
    varlen_prefill,
)

from ..distributed import TensorParallel
from ..weights.errors import CheckpointError
from ..weights.source import TensorSource
from .linear import Linear
from .norm import RMSNorm
from .rotary import apply_rotary

if TYPE_CHECKING:
    from ..models.config import ModelConfig


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
    sequence, 1 + d for one with d drafts) followed by the prefill chunks."""

    positions: torch.Tensor      # [T] int64 absolute position of each token
    slot_mapping: torch.Tensor   # [T] int64 cache slot of each token (block * block_size + offset)
    num_decode_tokens: int
    decode: DecodeMeta | None
    prefill: PrefillMeta | None
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [num_blocks, block_size, kv_heads, head_dim] each
    backend: str


class Attention(nn.Module):
    """x [T, hidden] -> [T, hidden]; writes the step's K/V into the layer's cache.

    num_heads / num_kv_heads are this rank's; its cache holds its kv heads only.
    q_norm / k_norm (qwen3, gemma3): an RMSNorm over each head's head_dim,
    before RoPE. rotary_dim (phi3's partial rotary): RoPE rotates each
    head's first rotary_dim dims only. softcap (gemma2): scores capped softly.
    kv_scales (k_scale, v_scale): the cache holds key / k_scale and value /
    v_scale (a float8 cache, tgi_kernels.fp8); the kernels read what it
    holds, so k_scale joins the softmax scale and v_scale the output.
    key_rotation (R, factor), a float8 cache's layer without a checkpoint
    k_scale (tgi_kernels.key_rotation): queries and keys are turned by R after
    RoPE, so the cache holds k @ R, and 1 / factor joins the softmax scale."""

    def __init__(self, qkv: Linear, o_proj: Linear, layer_idx: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, sliding_window: int, scale: float | None = None,
                 q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None, rotary_dim: int | None = None,
                 softcap: float = 0.0, kv_scales: tuple[float, float] = (1.0, 1.0),
                 key_rotation: tuple[torch.Tensor, float] | None = None):
        super().__init__()
        self.qkv, self.o_proj = qkv, o_proj
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sliding_window = sliding_window
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.q_norm, self.k_norm = q_norm, k_norm
        self.rotary_dim = rotary_dim  # None: RoPE rotates the whole head
        self.softcap = softcap  # > 0: scores capped softly (gemma2)
        self.kv_scales = kv_scales
        self.kv_scaled = kv_scales != (1.0, 1.0)
        # [head_dim, head_dim] where the keys are stored turned, else None
        self.register_buffer("key_rotation", None if key_rotation is None else key_rotation[0], persistent=False)
        if key_rotation is not None:
            self.scale /= key_rotation[1]

    @classmethod
    def load(cls, weights: TensorSource, prefix: str, layer_idx: int, heads: HeadShard, config: "ModelConfig",
             tp: TensorParallel) -> "Attention":
        """This rank's heads of layer `layer_idx` of `config` (a ModelConfig):
        q/k/v column-parallel by head, o_proj row-parallel; q/k norms whole
        (they act on one head at a time). The KV cache scales are read where
        weights.kv_scales (a float8 cache): `k_scale` and `v_scale`, or one
        `kv_scale` for both, as fp8 checkpoints store them; 1.0 without. Where
        the checkpoint has no k_scale the keys are stored turned (key_rotation);
        where it has one, they are not: it was measured on keys as they are,
        which turned ones could exceed."""
        head_dim = config.head_dim
        q_rows = (heads.q_start * head_dim, (heads.q_start + heads.num_heads) * head_dim)
        kv_rows = (heads.kv_start * head_dim, (heads.kv_start + heads.num_kv_heads) * head_dim)
        if config.fused_qkv:  # q's rows, then k's, then v's, in one qkv_proj tensor
            q_all, kv_all = config.num_heads * head_dim, config.num_kv_heads * head_dim
            name = f"{prefix}.qkv_proj"
            parts = [(name, *q_rows), (name, q_all + kv_rows[0], q_all + kv_rows[1]),
                     (name, q_all + kv_all + kv_rows[0], q_all + kv_all + kv_rows[1])]
        else:
            parts = [(f"{prefix}.q_proj", *q_rows), (f"{prefix}.k_proj", *kv_rows), (f"{prefix}.v_proj", *kv_rows)]
        qkv = Linear.load_column(weights, parts, config.attention_bias)
        o_proj = Linear.load_row(weights, f"{prefix}.o_proj", heads.num_heads * head_dim * tp.world_size,
                                 bias=False, tp=tp)
        norms = ((RMSNorm.load(weights, f"{prefix}.q_norm", config.rms_norm_eps, config.norm_offset),
                  RMSNorm.load(weights, f"{prefix}.k_norm", config.rms_norm_eps, config.norm_offset))
                 if config.qk_norm else (None, None))
        k_scale, v_scale = _kv_scales(weights, prefix) if weights.kv_scales else (1.0, 1.0)
        rotation = key_rotation(head_dim, weights.dtype, weights.device) if k_scale is None else None
        return cls(qkv, o_proj, layer_idx, heads.num_heads, heads.num_kv_heads, head_dim,
                   config.layers[layer_idx].sliding_window, config.attn_scale, *norms, config.rotary_dim,
                   config.attn_softcap, (k_scale or 1.0, v_scale or 1.0), rotation)

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, heads + 2 kv_heads, D] -> the same with q and k heads normed
        (a new contiguous tensor; v as it was)."""
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(qkv[:, :heads].reshape(-1, dim)).view(-1, heads, dim)
        k = self.k_norm(qkv[:, heads:heads + kv_heads].reshape(-1, dim)).view(-1, kv_heads, dim)
        return torch.cat([q, k, qkv[:, heads + kv_heads:]], dim=1)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
                ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden], cos_sin: (cos, sin) [T, 1, head_dim] each (see
        RotaryEmbedding), None where this layer applies no RoPE -> [T, hidden]."""
        tokens = x.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv(x).view(tokens, heads + 2 * kv_heads, self.head_dim)
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        k_scale, v_scale = self.kv_scales
        turned = self.key_rotation is not None
        if cos_sin is not None and self.rotary_dim is None and fuses_rotary(ctx.backend, turned):
            qkv = qkv.contiguous()  # a no-op after a GEMM; rotated in place
            rotary_store_kv(qkv, *cos_sin, heads, k_cache, v_cache, ctx.slot_mapping, k_scale, v_scale, ctx.backend,
                            turned)
            q = qkv[:, :heads]
            k = None  # sliced below only where a prefill reads it
        else:
            qk = qkv[:, :heads + kv_heads]  # q and k rotate together: [T, heads + kv_heads, head_dim]
            if cos_sin is not None and self.rotary_dim is None:
                qk = apply_rotary(qk, *cos_sin)
            elif cos_sin is not None:  # cos/sin [T, 1, rotary_dim]: the rest of each head passes through
                rd = self.rotary_dim
                qk = torch.cat([apply_rotary(qk[..., :rd], *cos_sin), qk[..., rd:]], dim=-1)
            if turned:
                qk = qk @ self.key_rotation
            q, k = qk[:, :heads], qk[:, heads:]
            store_kv(k, qkv[:, heads + kv_heads:], k_cache, v_cache, ctx.slot_mapping, ctx.backend, k_scale, v_scale)

        nd = ctx.num_decode_tokens
        scale = self.scale * k_scale  # scores q.k * scale = q.(k / k_scale) * scale'
        if ctx.prefill is None:  # every token decodes: no slicing (~2.5 us a view, 30 layers a step)
            out = paged_decode(q, k_cache, v_cache, ctx.decode, scale, self.sliding_window, ctx.backend,
                               self.softcap)
        else:
            k = qkv[:, heads:heads + kv_heads] if k is None else k
            v = qkv[:, heads + kv_heads:]
            if self.kv_scaled:  # the chunk's own keys and values on the cache's scale
                k, v = k / k_scale, v / v_scale
            out = varlen_prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, ctx.prefill, scale,
                                 self.sliding_window, ctx.backend, self.softcap)
            if ctx.decode is not None:
                decoded = paged_decode(q[:nd], k_cache, v_cache, ctx.decode, scale, self.sliding_window,
                                       ctx.backend, self.softcap)
                out = torch.cat([decoded, out], dim=0)  # [T, heads, head_dim]
        if self.kv_scaled:  # softmax-weighted values / v_scale
            out = out * v_scale
        return self.o_proj(out.reshape(tokens, heads * self.head_dim))


def _kv_scales(weights: TensorSource, prefix: str) -> tuple[float | None, float | None]:
    """(k_scale, v_scale) of one attention layer: `{prefix}.k_scale` and
    `.v_scale`, else `.kv_scale` for both, else None (scalars, or one-element
    tensors; one per layer, the same on every rank)."""
    def scale(*names: str) -> float | None:
        name = next((f"{prefix}.{n}" for n in names if weights.has(f"{prefix}.{n}")), None)
        if name is None:
            return None
        value = float(weights.get(name).float().reshape(-1)[0])
        if not 0 < value < float("inf"):
            raise CheckpointError(f"{name} is {value}: a KV cache scale must be positive and finite")
        return value
    return scale("k_scale", "kv_scale"), scale("v_scale", "kv_scale")
