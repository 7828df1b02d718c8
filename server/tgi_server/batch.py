"""Builds one step's flat input tensors from the scheduled sequences."""

from dataclasses import dataclass, fields, replace

import torch

from tgi_kernels import DecodeMeta, PrefillMeta, build_decode_meta, build_prefill_meta

from .layers.attention import ForwardContext
from .sequences import ShardSequence


@dataclass(frozen=True)
class StepBatch:
    """A ragged batch with no padding: decode rows first, then prefill
    chunks, flattened into T tokens. A decoding sequence is one decode row;
    one with d drafts is 1 + d decode rows, row i attending to the sequence's
    first computed + i + 1 positions (every row's K/V is stored before any
    row attends), which is exactly what decoding those tokens one step at a
    time computes, on the same kernels (compiled decode steps included)."""

    seqs: list[ShardSequence]    # in batch order (decodes, then prefills)
    input_ids: torch.Tensor      # [T] int64
    positions: torch.Tensor      # [T] int64
    slot_mapping: torch.Tensor   # [T] int64
    num_decode_tokens: int
    decode: DecodeMeta | None
    prefill: PrefillMeta | None
    logits_rows: torch.Tensor    # [S] int64 rows of the flat batch whose logits are needed
    sampling_seqs: list[ShardSequence]  # sequences that sample this step, in batch order
    sample_rows: list[int]       # per sampling sequence, its (first) row in the logits [S]: 1 + its drafts rows
    prompt_rows: list[tuple[ShardSequence, int, int]]  # (seq, first logits row, count) for prefill logprobs
    lora_segments: list[tuple[int, int, int]]  # (LoRA adapter > 0, first row, end row): runs of rows

    def context(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: str) -> ForwardContext:
        """The attention's view of this batch over the caches `kv_caches`."""
        return ForwardContext(positions=self.positions, slot_mapping=self.slot_mapping,
                              num_decode_tokens=self.num_decode_tokens, decode=self.decode, prefill=self.prefill,
                              kv_caches=kv_caches, backend=backend)

    def to(self, device: torch.device) -> "StepBatch":
        """The same batch with its tensors (metadata's included) on `device`."""
        return replace(self, input_ids=self.input_ids.to(device), positions=self.positions.to(device),
                       slot_mapping=self.slot_mapping.to(device), logits_rows=self.logits_rows.to(device),
                       decode=_meta_to(self.decode, device), prefill=_meta_to(self.prefill, device))


def build_batch(seqs: list[ShardSequence], block_size: int, device: torch.device) -> StepBatch:
    decodes = [s for s in seqs if s.scheduled == 1 + s.drafted]
    prefills = [s for s in seqs if s.scheduled > 1 + s.drafted]
    if any(s.adapter for s in seqs):  # each adapter's tokens in one run of decodes and one of prefills
        decodes.sort(key=lambda s: s.adapter)
        prefills.sort(key=lambda s: s.adapter)
    ordered = decodes + prefills
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    sample_rows: list[int] = []
    prompt_rows: list[tuple[ShardSequence, int, int]] = []
    lora_segments: list[tuple[int, int, int]] = []
    for seq in ordered:
        start, n = seq.num_computed, seq.scheduled
        first = len(ids)
        if seq.adapter:
            if lora_segments and lora_segments[-1][0] == seq.adapter and lora_segments[-1][2] == first:
                lora_segments[-1] = (seq.adapter, lora_segments[-1][1], first + n)
            else:
                lora_segments.append((seq.adapter, first, first + n))
        ids.extend(seq.token_ids[start:start + n])
        positions.extend(range(start, start + n))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        if seq.prefill_logprobs and start < seq.prompt_length:
            # logits at every computed position: row i predicts token start + i + 1
            prompt_rows.append((seq, len(logits_rows), n))
            logits_rows.extend(range(first, first + n))
            if seq.samples_this_step:
                sample_rows.append(len(logits_rows) - 1)
        elif seq.samples_this_step:  # the last known token's row, then each draft's
            sample_rows.append(len(logits_rows))
            logits_rows.extend(range(first + n - 1 - seq.drafted, first + n))

    def tensor(values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype, device=device)

    return StepBatch(
        seqs=ordered,
        input_ids=tensor(ids),
        positions=tensor(positions),
        slot_mapping=tensor(slots),
        num_decode_tokens=sum(s.scheduled for s in decodes),
        decode=build_decode_meta([s.num_computed + i + 1 for s in decodes for i in range(s.scheduled)],
                                 [_blocks(s, block_size) for s in decodes for _ in range(s.scheduled)],
                                 device) if decodes else None,
        prefill=build_prefill_meta([s.scheduled for s in prefills], [s.num_computed for s in prefills],
                                   [_blocks(s, block_size) for s in prefills], device) if prefills else None,
        logits_rows=tensor(logits_rows),
        sampling_seqs=[s for s in ordered if s.samples_this_step],
        sample_rows=sample_rows,
        prompt_rows=prompt_rows,
        lora_segments=lora_segments,
    )


def _blocks(seq: ShardSequence, block_size: int) -> list[int]:
    """The blocks covering the sequence's computed + scheduled tokens."""
    return seq.block_table[:-(-(seq.num_computed + seq.scheduled) // block_size)]


def _meta_to(meta: DecodeMeta | PrefillMeta | None, device: torch.device):
    if meta is None:
        return None
    moved = {f.name: getattr(meta, f.name).to(device) for f in fields(meta)
             if isinstance(getattr(meta, f.name), torch.Tensor)}
    if isinstance(meta, DecodeMeta):
        moved["derived"] = {}  # built from the device tensors by the step's first layer
    return replace(meta, **moved)
