"""The decode attention benchmark's flex_attention way (benchmarks/decode_attention.py)
computes paged decode: its block mask, made from the block tables, gives
the reference backend's output (flex_attention run eagerly here; the
benchmark compiles it)."""

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from benchmarks.decode_attention import HEAD_DIM, flex_block_mask, flex_decode, paged_batch
from tgi_kernels import attention as attn


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("batch,context", [(1, 5), (3, 16), (4, 40)])
def test_the_flex_block_mask_reads_each_sequences_blocks_up_to_its_length(batch, context):
    query, k_cache, v_cache, meta = paged_batch(batch, context, torch.float32, seed=batch)
    scale = HEAD_DIM ** -0.5
    mask = flex_block_mask(meta, k_cache.shape[0])
    got = flex_decode(flex_attention, query, k_cache, v_cache, mask, scale)
    want = attn.paged_decode(query, k_cache, v_cache, meta, scale, backend="reference")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
