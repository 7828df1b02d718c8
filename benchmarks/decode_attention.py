"""Paged decode attention, one layer at SmolLM2's shapes (9 query heads over
3 KV heads of 64, blocks of 16 tokens, the serving dtype), 2 threads, per way
of computing it:
- `cpu`: our C++ kernel, reading each sequence's blocks in place;
- `sdpa`: torch's SDPA over the blocks gathered into a dense tensor;
- `flex`: torch's flex_attention compiled by inductor (its C++ template on
  the CPU) over the whole cache, with a block mask made from the block
  tables: each sequence's blocks are its KV blocks, all but the last full,
  the last cut at the sequence's length by a mask_mod. Issue 18 asked for it
  to be tried beside the other two; the mask is built once a step and shared
  by the layers, so its time is reported apart.
Each is checked against the reference backend (plain torch) before it is
timed. Blocks are scattered over the cache at random, as a serving cache
holds them. Keys: decode_attention_b{B}_ctx{L}_{way}_ms (one layer) and
decode_attention_flex_mask_b{B}_ctx{L}_ms."""

import time
from functools import partial

import torch

from tgi_kernels import DecodeMeta
from tgi_kernels import attention as attn
from tgi_kernels.cpu import is_available as cpu_kernels_built

from . import engine as engine_bench
from .machine import CPU, dtype_name, serving_dtype

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SHAPES = ((1, 192), (8, 192), (32, 192), (64, 192), (32, 1024))  # (sequences, tokens of context)
REPEATS = 20


def paged_batch(batch: int, context: int, dtype: torch.dtype, seed: int = 0):
    """(query [B, H, D], k_cache, v_cache [blocks, BLOCK, KVH, D], DecodeMeta):
    contexts of context - 15 (at least 1) .. context tokens on blocks in random order
    (block 0 unused, as the serving cache keeps a scratch block)."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-context // BLOCK)
    blocks = batch * width + 1
    k_cache = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    tables = (torch.randperm(blocks - 1, generator=gen) + 1).view(batch, width).to(torch.int32)
    lens = context - torch.randint(0, min(BLOCK, context), (batch,), generator=gen, dtype=torch.int32)
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    return query, k_cache, v_cache, DecodeMeta(block_tables=tables, seq_lens=lens, max_seq_len=context)


def flex_block_mask(meta: DecodeMeta, blocks: int):
    """The step's BlockMask: query b (one row) reads KV blocks block_tables[b]
    of the cache seen as one sequence of blocks * BLOCK tokens, up to
    seq_lens[b]. Its mask_mod is that whole rule (cache block -> the sequence
    holding it and its place there); the block lists only spare the kernel
    the blocks it cannot pass: every block of a sequence but its last is
    listed full (read without the mask_mod), the last as partial. Index rows
    are as wide as the cache: inductor's template asks the mask to span every
    KV token."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, width = meta.block_tables.shape
    used = (meta.seq_lens.long() + BLOCK - 1) // BLOCK                     # [B] blocks a sequence reads
    owner = torch.full((blocks,), -1, dtype=torch.long)                    # [blocks] sequence of a block
    place = torch.zeros(blocks, dtype=torch.long)                          # [blocks] its index in the table
    owner[meta.block_tables.long()] = torch.arange(batch).view(batch, 1).expand(batch, width)
    place[meta.block_tables.long()] = torch.arange(width).view(1, width).expand(batch, width)
    lens = meta.seq_lens.long()
    full = torch.zeros(batch, 1, 1, blocks, dtype=torch.int32)
    full[..., :width] = meta.block_tables.view(batch, 1, 1, width)
    last = torch.zeros(batch, 1, 1, blocks, dtype=torch.int32)
    last[..., 0] = meta.block_tables.gather(1, (used - 1).view(batch, 1)).view(batch, 1, 1)

    def reads(b, h, q_idx, kv_idx):
        block = kv_idx // BLOCK
        return (owner[block] == b) & (place[block] * BLOCK + kv_idx % BLOCK < lens[b])
    return BlockMask.from_kv_blocks(torch.ones(batch, 1, 1, dtype=torch.int32), last,
                                    (used - 1).to(torch.int32).view(batch, 1, 1), full,
                                    BLOCK_SIZE=(1, BLOCK), mask_mod=reads, seq_lengths=(1, blocks * BLOCK))


def flex_decode(flex, query, k_cache, v_cache, block_mask, scale: float) -> torch.Tensor:
    """query [B, H, D] -> [B, H, D] through `flex` (compiled flex_attention)
    over the cache viewed as [B (broadcast), KVH, blocks * BLOCK, D], no copy."""
    batch, blocks = query.shape[0], k_cache.shape[0]

    def seq(cache):
        return cache.view(blocks * BLOCK, KV_HEADS, HEAD_DIM).permute(1, 0, 2).unsqueeze(0).expand(batch, -1, -1, -1)
    out = flex(query.unsqueeze(2), seq(k_cache), seq(v_cache), block_mask=block_mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def _ms(fn) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(REPEATS):
        fn()
    return (time.perf_counter() - start) / REPEATS * 1e3


def run() -> dict:
    from torch.nn.attention.flex_attention import flex_attention

    torch.set_num_threads(engine_bench.THREADS)
    dtype, scale = serving_dtype(), HEAD_DIM ** -0.5
    flex = torch.compile(flex_attention, dynamic=False)
    ways = ("cpu", "sdpa", "flex") if cpu_kernels_built(CPU) else ("sdpa", "flex")
    out = {"decode_attention_dtype": dtype_name(dtype)}
    print(f"\nPaged decode attention, one layer: {HEADS} query heads over {KV_HEADS} KV heads of {HEAD_DIM}, "
          f"blocks of {BLOCK}, {dtype_name(dtype)}, {engine_bench.THREADS} threads; ms")
    print(f"{'sequences':>9}{'context':>8}" + "".join(f"{w:>9}" for w in ways) + f"{'flex mask':>11}")
    for batch, context in SHAPES:
        query, k_cache, v_cache, meta = paged_batch(batch, context, dtype)
        mask = flex_block_mask(meta, k_cache.shape[0])
        calls = {"cpu": partial(attn.paged_decode, query, k_cache, v_cache, meta, scale, backend="cpu"),
                 "sdpa": partial(attn.paged_decode, query, k_cache, v_cache, meta, scale, backend="sdpa"),
                 "flex": partial(flex_decode, flex, query, k_cache, v_cache, mask, scale)}
        want = attn.paged_decode(query, k_cache, v_cache, meta, scale, backend="reference").float()
        row = f"{batch:>9}{context:>8}"
        for way in ways:
            error = (calls[way]().float() - want).abs().max().item()
            if error > 0.02:  # a few bf16 roundings of values ~N(0, 1)
                raise AssertionError(f"{way} differs from the reference by {error} at {batch} x {context}")
            ms = _ms(calls[way])
            out[f"decode_attention_b{batch}_ctx{context}_{way}_ms"] = round(ms, 4)
            row += f"{ms:>9.3f}"
        mask_ms = _ms(partial(flex_block_mask, meta, k_cache.shape[0]))
        out[f"decode_attention_flex_mask_b{batch}_ctx{context}_ms"] = round(mask_ms, 3)
        print(row + f"{mask_ms:>11.3f}", flush=True)
    return out
