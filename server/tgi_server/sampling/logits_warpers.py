"""top_k, top_p, typical_p and min_p with Hugging Face semantics, on candidate sets.

`filter_candidates` takes temperature-scaled logits and, for rows asking for
any of these warpers, returns per row a candidate set that holds every token
surviving them, in that order: (logits [S, C], ids [S, C]), -inf for dropped
tokens and padding. It never sorts a whole vocabulary row unless it must:
top_k rows look at their k best blocks, top_p rows at a few best blocks (more
when those hold less than top_p of the mass), min_p rows at the blocks whose
maximum passes the threshold; only typical_p without top_k/top_p sees every
token. A candidate set is exact: each row's result is what HF's warpers give on
the full row, whatever the batch, except that logits tied at the top_p cut are
kept or dropped together (HF keeps whichever its sort happens to put first).

Sums that decide which tokens survive are sequential float64 cumsums over
value-sorted (or vocabulary-ordered) candidates, so they round the same way
whatever the batch and whatever the padding."""

from typing import Callable, Sequence

import torch

from .sampling_params import SamplingParams
from .vocab_blocks import BLOCK, NEG_INF, BlockedRows, argsort_rows, exp_rows, to_device, topk_desc

# top_p looks at the tokens of its best 4 blocks, then 32, then all of them.
TOP_P_BLOCKS = (4, 32)
_SAFETY = 1e-3  # margin on t0 against rounding

Part = tuple[list[int], torch.Tensor, torch.Tensor]  # (rows, logits [r, W], ids [r, W])


def filters(p: SamplingParams) -> bool:
    """Whether a sampling row needs candidate filtering (any warper but temperature)."""
    return p.top_k > 0 or p.top_p < 1.0 or p.typical_p < 1.0 or p.min_p > 0.0


def filter_candidates(xb: BlockedRows, rows: Sequence[int], params: Sequence[SamplingParams]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates of xb's `rows` (params[j] for rows[j]): (logits [S, C], ids [S, C])."""
    by_kind: tuple[list[int], ...] = ([], [], [], [])  # top_k, top_p, typical_p, min_p only
    for j, p in enumerate(params):
        kind = 0 if p.top_k > 0 else 1 if p.top_p < 1.0 else 2 if p.typical_p < 1.0 else 3
        by_kind[kind].append(j)
    parts: list[Part] = []
    if by_kind[0]:
        parts.append(_top_k_candidates(xb, [rows[j] for j in by_kind[0]], by_kind[0], params))
    if by_kind[1]:
        parts += _top_p_candidates(xb, [rows[j] for j in by_kind[1]], by_kind[1], params)
    if by_kind[2]:
        whole = xb.head(_index(xb, [rows[j] for j in by_kind[2]]), xb.num_blocks, None)
        parts.append((by_kind[2], whole[0], whole[1]))
    if by_kind[3]:
        parts.append(_min_p_candidates(xb, [rows[j] for j in by_kind[3]], by_kind[3], params))
    vals, ids = _assemble(parts, len(params))
    _on_rows(vals, [p.typical_p for p in params], lambda m: m < 1.0, _typical_p)
    _on_rows(vals, [p.min_p for p in params], lambda m: m > 0.0, _min_p)
    return vals, ids


def _index(xb: BlockedRows, rows: list[int]) -> torch.Tensor:
    return to_device(rows, xb.x.device)


def _column(values: list, device: torch.device, dtype=torch.float32) -> torch.Tensor:
    return to_device(values, device, dtype).unsqueeze(1)  # [R, 1]


def _top_k_candidates(xb: BlockedRows, rows: list[int], out_rows: list[int],
                      params: Sequence[SamplingParams]) -> Part:
    """HF TopKLogitsWarper (ties with the k-th logit kept), then top_p if asked."""
    ks = [min(params[j].top_k, xb.vocab) for j in out_rows]
    k = _column(ks, xb.x.device, torch.int64)  # [R, 1]
    index = _index(xb, rows)
    # The k largest logits lie in the k blocks with the largest maxima; grow
    # until no logit tied with the k-th is left outside the candidates.
    num_blocks, keep = min(max(ks), xb.num_blocks), max(ks) + 1
    while True:
        vals, ids, bound = xb.head(index, num_blocks, keep)
        kth = vals.gather(1, k - 1)  # [R, 1]
        inside_blocks = (bound.unsqueeze(1) == NEG_INF) | (kth > bound.unsqueeze(1))
        inside_keep = (keep >= num_blocks * BLOCK) | (vals[:, -1:] < kth)
        if bool((inside_blocks & inside_keep).all()):
            break
        num_blocks, keep = min(2 * num_blocks, xb.num_blocks), 2 * keep
    vals.masked_fill_(vals < kth, NEG_INF)
    _on_rows(vals, [params[j].top_p for j in out_rows], lambda p: p < 1.0,
             lambda v, p: _top_p(v, p, None))
    return out_rows, *_trim(vals, ids)


def _top_p_candidates(xb: BlockedRows, rows: list[int], out_rows: list[int],
                      params: Sequence[SamplingParams]) -> list[Part]:
    """HF TopPLogitsWarper on rows without top_k, without sorting whole rows.

    Tokens at or below a threshold are all dropped once the tokens above it
    hold top_p of the mass, so only those need sorting. Two thresholds qualify:
    the (m+1)-th largest block maximum, when the m best blocks' tokens above it
    hold top_p of the mass (m grows until they do), and, always, the t0 at
    which even V tokens at t0 would hold less than 1 - top_p of it."""
    parts: list[Part] = []
    index = _index(xb, rows)
    top_p = _column([params[j].top_p for j in out_rows], xb.x.device)  # [R, 1]
    total = xb.exp_block_sums(index).double().sum(dim=1, keepdim=True)  # [R, 1] mass of each row
    top = xb.top[index].unsqueeze(1)  # [R, 1]
    floor = top + (total * (1.0 - top_p.double()) / xb.vocab).log().float() - _SAFETY  # [R, 1] t0
    pending = torch.arange(len(rows), device=index.device)
    for num_blocks in TOP_P_BLOCKS + (xb.num_blocks,):
        vals, ids, bound = xb.head(index[pending], num_blocks, None)  # [P, m * BLOCK]
        threshold = torch.maximum(bound.unsqueeze(1), floor[pending])  # [P, 1]
        covered = floor[pending, 0] >= bound
        if not bool(covered.all()):
            above = torch.where(vals > threshold, exp_rows(vals - top[pending]), 0.0)
            mass = above.cumsum(dim=1, dtype=torch.float64)[:, -1]
            covered |= mass >= top_p[pending, 0].double() * total[pending, 0]
        done = covered.nonzero().squeeze(1)
        if len(done):
            vals, threshold = vals[done], threshold[done]
            vals, best = topk_desc(vals, max(int((vals > threshold).sum(dim=1).max()), 1))
            vals.masked_fill_(vals <= threshold, NEG_INF)
            ids = ids[done].gather(1, best)
            _top_p(vals, top_p[pending[done]], total[pending[done]])
            parts.append(([out_rows[j] for j in pending[done].tolist()], *_trim(vals, ids)))
        pending = pending[~covered]
        if not len(pending):
            break
    return parts


def _top_p(vals: torch.Tensor, top_p: torch.Tensor, total: torch.Tensor | None) -> None:
    """Drop, in vals [R, W] sorted descending, the tokens whose strictly more likely
    tokens already hold top_p of the mass (HF's ascending `cumsum <= 1 - top_p`).

    Tied logits stand or fall together: HF keeps whichever of them its sort
    happens to put first, which would make the draw depend on the batch.
    total [R, 1] float64: each row's mass relative to its max, when the
    candidates are not the whole row."""
    e = exp_rows(vals - vals[:, :1])  # [R, W]
    cum = e.cumsum(dim=1, dtype=torch.float64)
    if total is None:
        total = cum[:, -1:]
    run_start = torch.ones_like(vals, dtype=torch.bool)
    run_start[:, 1:] = vals[:, 1:] != vals[:, :-1]
    # The mass strictly above each token: that before the start of its run of ties.
    above = torch.where(run_start, cum - e, float("-inf")).cummax(dim=1).values
    drop = above >= top_p.double() * total
    drop[:, 0] = False
    vals.masked_fill_(drop, NEG_INF)


def _min_p_candidates(xb: BlockedRows, rows: list[int], out_rows: list[int],
                      params: Sequence[SamplingParams]) -> Part:
    """Rows with min_p only: the blocks holding a token that passes the threshold."""
    index = _index(xb, rows)
    min_p = _column([params[j].min_p for j in out_rows], xb.x.device)
    threshold = xb.top[index].unsqueeze(1) + min_p.log()  # [R, 1]
    num_blocks = int((xb.bmax[index] >= threshold).sum(dim=1).max())
    vals, ids, _ = xb.head(index, max(num_blocks, 1), None)
    return out_rows, vals, ids


def _typical_p(vals: torch.Tensor, mass: torch.Tensor) -> None:
    """HF TypicalLogitsWarper on complete candidate rows [R, C] (any order)."""
    shifted_logits = vals - vals.amax(dim=1, keepdim=True)
    total = exp_rows(shifted_logits).cumsum(dim=1, dtype=torch.float64)[:, -1:]
    logp = shifted_logits - total.log().float()  # [R, C]
    p = exp_rows(logp)
    ent = -torch.where(p > 0, logp * p, 0.0).cumsum(dim=1, dtype=torch.float64)[:, -1:].float()
    shifted = (-logp - ent).abs()  # [R, C]; inf for dropped tokens
    order = argsort_rows(shifted)
    sorted_shift = shifted.gather(1, order)
    cum = p.gather(1, order).cumsum(dim=1, dtype=torch.float64)
    last = (cum < mass.double()).sum(dim=1, keepdim=True).clamp_(max=vals.shape[1] - 1)  # [R, 1]
    drop_sorted = sorted_shift > sorted_shift.gather(1, last)
    drop_sorted[:, 0] = False
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    vals.masked_fill_(drop, NEG_INF)


def _min_p(vals: torch.Tensor, min_p: torch.Tensor) -> None:
    """HF MinPLogitsWarper: p < min_p * p_max  <=>  logit < max logit + log(min_p)."""
    vals.masked_fill_(vals < vals.amax(dim=1, keepdim=True) + min_p.log(), NEG_INF)


def _trim(vals: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop trailing columns of descending candidates that are -inf in every row."""
    width = max(int((vals > NEG_INF).sum(dim=1).max()), 1)
    return vals[:, :width], ids[:, :width]


def _assemble(parts: list[Part], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the parts' candidates into (logits [S, C], ids [S, C]), padding with -inf."""
    if len(parts) == 1 and parts[0][0] == list(range(rows)):
        return parts[0][1], parts[0][2]
    device = parts[0][1].device
    width = max(v.shape[1] for _, v, _ in parts)
    vals = torch.full((rows, width), NEG_INF, device=device)
    ids = torch.zeros((rows, width), dtype=torch.int64, device=device)
    for part_rows, v, i in parts:
        index = to_device(part_rows, device)
        vals[:, :v.shape[1]].index_copy_(0, index, v)
        ids[:, :i.shape[1]].index_copy_(0, index, i)
    return vals, ids


def _on_rows(vals: torch.Tensor, values: list, active: Callable,
             fn: Callable[[torch.Tensor, torch.Tensor], object]) -> None:
    """Run fn(rows [R, C], values [R, 1]) in place on the rows whose value is active."""
    rows = [i for i, v in enumerate(values) if active(v)]
    if not rows:
        return
    column = _column([values[i] for i in rows], vals.device)
    if len(rows) == vals.shape[0]:
        fn(vals, column)
        return
    index = to_device(rows, vals.device)
    sub = vals.index_select(0, index)
    fn(sub, column)
    vals.index_copy_(0, index, sub)
