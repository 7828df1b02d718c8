"""The paged KV cache: per layer, K and V of [num_blocks + 1, block_size,
kv_heads, head_dim], in the model's dtype or float8 (--kv-cache-dtype: one
byte an element, tgi_kernels.fp8). Block ids 0..num_blocks-1 belong to the
router; the extra last block is the shard's scratch space for warmup and
health checks. Under tensor parallelism a rank caches only its own kv heads."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int           # this rank's
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim  # K and V
        return per_token * self.block_size * torch.empty((), dtype=self.dtype).element_size()


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device):
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        self.scratch_block = num_blocks
        shape = (num_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # Zeros, not empty: decode reads whole blocks and masks the unused
        # slots, and a masked NaN still poisons the softmax-weighted sum.
        self.layers = [(torch.zeros(shape, dtype=spec.dtype, device=device),
                        torch.zeros(shape, dtype=spec.dtype, device=device))
                       for _ in range(spec.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)
