"""Attention metadata: what a kernel needs to know about the sequences of one step.

The model runner builds these once per step and passes the same objects to every
layer. Tensors live on the model's device; the python copies let CPU-side code
(loop bounds, output sizes) avoid device synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PrefillMeta:
    """Sequences whose query has >1 token or that read a cached prefix (chunked prefill / prefix hit).

    Sequence b owns query tokens `cu_seqlens_q[b]:cu_seqlens_q[b+1]` of the flat batch;
    its query token i sits at absolute position `prefix_lens[b] + i`. The KV of the
    prefix (positions < prefix_len) is read from the paged cache through `block_tables`.
    """

    cu_seqlens_q: torch.Tensor  # [B+1] int32, start offset of each sequence's query tokens in the flat batch
    prefix_lens: torch.Tensor  # [B] int32, tokens of each sequence already in the KV cache BEFORE this chunk
    block_tables: torch.Tensor  # [B, max_blocks] int32, block ids (padded with 0)
    query_lens: list[int]  # python copies so CPU code never syncs
    prefix_lens_list: list[int]
    max_query_len: int
    max_seq_len: int  # max(prefix + query)


@dataclass(frozen=True)
class DecodeMeta:
    """Sequences computing exactly one new token, reading their context from the paged cache.

    `seq_lens[b] >= 1` counts the current token, whose KV is already stored, so the
    query of sequence b sits at absolute position `seq_lens[b] - 1`.
    """

    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, context length INCLUDING the current token (already stored in cache)
    max_seq_len: int
    # Tensors a backend derives from the fields above (gather indices, masks),
    # built by the first layer of a step and reused by the others.
    derived: dict = field(default_factory=dict, compare=False, repr=False)


def _pad_block_tables(block_tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(row) for row in block_tables), default=0)
    padded = [row + [0] * (width - len(row)) for row in block_tables]
    return torch.tensor(padded, dtype=torch.int32, device=device).view(len(block_tables), width)


def build_prefill_meta(
    query_lens: list[int],
    prefix_lens: list[int],
    block_tables: list[list[int]],
    device: torch.device | str = "cpu",
) -> PrefillMeta:
    """Build a PrefillMeta from python lists (one entry per sequence)."""
    offsets = [0]
    for n in query_lens:
        offsets.append(offsets[-1] + n)
    return PrefillMeta(
        cu_seqlens_q=torch.tensor(offsets, dtype=torch.int32, device=device),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=device),
        block_tables=_pad_block_tables(block_tables, torch.device(device)),
        query_lens=list(query_lens),
        prefix_lens_list=list(prefix_lens),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max((p + q for p, q in zip(prefix_lens, query_lens)), default=0),
    )


def build_decode_meta(
    seq_lens: list[int],
    block_tables: list[list[int]],
    device: torch.device | str = "cpu",
) -> DecodeMeta:
    """Build a DecodeMeta from python lists (one entry per sequence)."""
    return DecodeMeta(
        block_tables=_pad_block_tables(block_tables, torch.device(device)),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_seq_len=max(seq_lens, default=0),
    )
