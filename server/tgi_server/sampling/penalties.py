"""Batched repetition, frequency and presence penalties.

Only the logits of tokens a row has seen change, so the penalties are applied
sparsely: one gather and one scatter at the (row, token) positions of the rows
that ask for a penalty, never a pass over their whole vocabulary."""

from itertools import chain
from typing import Sequence

import numpy as np
import torch

from .sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams],
                    token_ids: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> None:
    """Penalize contiguous logits [B, W] float32 (W >= vocabulary) in place for the given rows.

    token_ids[i] holds row i's prompt then generated tokens, prompt_lens[i] how
    many of them are prompt. The repetition penalty (HF: logit > 0 -> logit / p,
    else logit * p) sees all of them, once per distinct token; the frequency and
    presence penalties (OpenAI: logit -= freq * count + pres * (count > 0)) see
    the generated ones only."""
    flat = logits.view(-1)  # [B * W]
    width = logits.shape[1]
    rep_rows = [i for i in rows if params[i].repetition_penalty != 1.0]
    if rep_rows:
        where, row_of = _positions([token_ids[i] for i in rep_rows], rep_rows, width, logits.device)
        penalty = _per_row(rep_rows, [params[i].repetition_penalty for i in rep_rows], row_of, logits)
        seen = flat[where]  # [N]; a repeated token writes the same value twice
        flat[where] = torch.where(seen > 0, seen / penalty, seen * penalty)

    count_rows = [i for i in rows if params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0]
    if count_rows:
        generated = [token_ids[i][prompt_lens[i]:] for i in count_rows]
        where, _ = _positions(generated, count_rows, width, logits.device)
        where, counts = torch.unique(where, return_counts=True)  # distinct (row, token), [U]
        row_of = where // width
        freq = _per_row(count_rows, [params[i].frequency_penalty for i in count_rows], row_of, logits)
        pres = _per_row(count_rows, [params[i].presence_penalty for i in count_rows], row_of, logits)
        flat[where] -= freq * counts.to(logits.dtype) + pres


def _positions(seqs: Sequence[Sequence[int]], rows: Sequence[int], width: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat index row * width + token [N], batch row [N]) of every token of seqs (seqs[j] in row rows[j])."""
    lengths = torch.tensor([len(s) for s in seqs])  # [R]
    count = int(lengths.sum())
    tokens = torch.from_numpy(np.fromiter(chain.from_iterable(seqs), dtype=np.int64, count=count))
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)  # [N]
    return (row_of * width + tokens).to(device), row_of.to(device)


def _per_row(rows: Sequence[int], values: Sequence[float], row_of: torch.Tensor,
             logits: torch.Tensor) -> torch.Tensor:
    """values[j] (for batch row rows[j]) at every position whose batch row is row_of: [N]."""
    table = torch.zeros(logits.shape[0], dtype=logits.dtype, device=logits.device)
    table[torch.tensor(rows, device=logits.device)] = torch.tensor(values, dtype=logits.dtype,
                                                                   device=logits.device)
    return table[row_of]
