"""The paged KV cache: per layer, K and V of [num_blocks + 1, block_size,
kv_heads, head_dim]. Block ids 0..num_blocks-1 belong to the router; the
extra last block is the shard's scratch space for warmup and health checks."""

import torch

from .models import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks
        shape = (num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        # Zeros, not empty: decode reads whole blocks and masks the unused
        # slots, and a masked NaN still poisons the softmax-weighted sum.
        self.layers = [(torch.zeros(shape, dtype=dtype, device=device),
                        torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(config.num_layers)]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
        return per_token * block_size * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)
