"""The shard's batched next-token chooser (TGI's HeterogeneousNextTokenChooser).

Per step: penalties, then logits processors (grammar masks), then for sampling
rows temperature and the filtering warpers; greedy rows take the argmax,
sampling rows draw.

Determinism: a sampling row's draw is a function of its own final logits and
of one uniform number u = hash(seed, position) (splitmix64: integer arithmetic,
the same in every process and on every device). The row takes the token at
which u falls on its cumulative distribution laid out in vocabulary order
(float64 sums), an exact multinomial draw. Every sum involved is computed per
row (or per block) in an order fixed by the row alone, so nothing depends on
the batch companions, the batch order or the batch size."""

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from .logits_warpers import filter_candidates, filters
from .penalties import apply_penalties
from .sampling_params import SamplingParams
from .vocab_blocks import (
    BLOCK,
    CPU_CHUNK_ROWS,
    NEG_INF,
    BlockedRows,
    argsort_rows,
    exp_rows,
    greedy_rows,
    padded_width,
    to_device,
)
from .watermark import Watermark

__all__ = ["LogitsProcessor", "Sampler", "SamplerOutput", "SamplingParams", "draw_uniform",
           "prompt_logprobs"]

_MASK64 = (1 << 64) - 1
_PROMPT_CHUNK = 1024  # prompt logprobs are computed this many positions at a time

TopTokens = list[list[tuple[int, float]]]
# One group of rows: (batch rows, tokens [r], logprobs [r], top-n (logprobs [r, n], ids [r, n]) or None)
Group = tuple[list[int], torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]


@dataclass(frozen=True)
class SamplerOutput:
    """One step's choice for every row of the batch, in batch order."""

    token_ids: list[int]  # [B] chosen token of each row
    logprobs: list[float]  # [B] log-probability of the chosen token
    # [B] per row up to top_n_tokens (token_id, logprob), most likely first; [] when 0.
    # Logprobs are those of the final distribution: warped for sampling rows,
    # penalized and processed for greedy rows. Tokens at -inf (filtered out by
    # a warper or a processor) are never listed, as in TGI.
    top_tokens: TopTokens


class LogitsProcessor(Protocol):
    """Hook for grammar masks: modifies logits [B, V] float32 in place for the rows it governs.

    Called after penalties and before warpers, rows in the order of `params`."""

    def __call__(self, logits: torch.Tensor) -> None: ...


class Sampler:
    """Chooses the next token of every row of a batch.

    Holds no state between steps, only reusable scratch buffers (fresh
    full-vocabulary tensors cost page faults on every step), so one Sampler
    must not be called from two threads at once."""

    def __init__(self, watermark: Watermark | None = None):
        self._buffers: dict[tuple[str, torch.device], torch.Tensor] = {}
        self.watermark = watermark or Watermark()  # for rows whose params ask for it

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 token_ids: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                 processors: Sequence[LogitsProcessor] = ()) -> SamplerOutput:
        """logits [B, V] (any float dtype, left untouched); token_ids[i] = all tokens of
        row i so far (prompt, then generated); prompt_lens[i] = how many are prompt.
        The token chosen for row i takes position len(token_ids[i])."""
        batch, vocab = logits.shape
        if batch == 0:
            return SamplerOutput([], [], [])
        pen_rows = [i for i, p in enumerate(params) if p.needs_penalties]
        marked = [i for i, p in enumerate(params) if p.watermark]
        writes = bool(pen_rows or processors or marked)
        if not writes and not any(p.do_sample or p.top_n_tokens for p in params):
            # Every row greedy and nothing to change: straight from the logits
            # (no float32 copy of the batch), as _greedy would choose.
            chosen = greedy_rows(logits, None)
            if chosen is not None:
                tokens, lse = chosen
                logprobs = logits.gather(1, tokens.unsqueeze(1)).squeeze(1).float() - lse
                return _output([(list(range(batch)), tokens, logprobs, None)], params, batch)
        x = self._working_copy(logits, writes)  # [B, W]
        # TGI's order: the watermark's bias, then the penalties, then processors.
        self.watermark.apply(x, marked, [token_ids[i][-1] for i in marked], vocab)
        apply_penalties(x, pen_rows, params, token_ids, prompt_lens)
        for processor in processors:
            processor(x[:, :vocab])

        temps = [p.temperature if p.do_sample else 1.0 for p in params]
        temperature = None
        if any(t != 1.0 for t in temps):
            temperature = to_device(temps, x.device, x.dtype).unsqueeze(1)
        chunk = self._buffer("chunk", CPU_CHUNK_ROWS * x.shape[1], x.device)
        xb = BlockedRows(x, vocab, temperature, chunk)
        groups: list[Group] = []
        greedy = [i for i, p in enumerate(params) if not p.do_sample]
        if greedy:
            groups.append(_greedy(xb, greedy, params))
        plain = [i for i, p in enumerate(params) if p.do_sample and not filters(p)]
        filtered = [i for i, p in enumerate(params) if p.do_sample and filters(p)]
        uniforms = {i: draw_uniform(params[i].seed, len(token_ids[i])) for i in plain + filtered}
        if plain:
            groups.append(_draw_dense(xb, plain, params, uniforms))
        if filtered:
            vals, ids = filter_candidates(xb, filtered, [params[i] for i in filtered])
            groups.append(_draw_candidates(vals, ids, filtered, params, uniforms))
        return _output(groups, params, batch)

    def _working_copy(self, logits: torch.Tensor, writes: bool) -> torch.Tensor:
        """logits as float32 [B, W] contiguous, padded with -inf to W = padded_width(V):
        logits itself when it already is and nothing writes to it, else a reused buffer."""
        batch, vocab = logits.shape
        width = padded_width(vocab)
        if (not writes and width == vocab and logits.dtype == torch.float32
                and logits.is_contiguous()):
            return logits
        x = self._buffer("work", batch * width, logits.device).view(batch, width)
        x[:, :vocab].copy_(logits)
        x[:, vocab:].fill_(NEG_INF)
        return x

    def _buffer(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        key = (name, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[key] = torch.empty(numel, dtype=torch.float32, device=device)
        return buf[:numel]


def draw_uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) that fixes the draw of (seed, position):
    with splitmix64(x) the first output of a SplitMix64 generator seeded with
    x, the top 53 bits of splitmix64(splitmix64(seed) XOR position), over 2**53
    (both taken modulo 2**64)."""
    z = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (z >> 11) * 2.0 ** -53


@torch.no_grad()
def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> list[float]:
    """log_softmax(logits)[i, targets[i]] in float32, of the raw model distribution.

    logits [N, V] at consecutive positions; targets [N] the tokens that follow."""
    targets = targets.to(logits.device, torch.int64)
    out = []
    for start in range(0, logits.shape[0], _PROMPT_CHUNK):
        chunk = logits[start:start + _PROMPT_CHUNK].float()  # [n, V]
        picked = chunk.gather(1, targets[start:start + _PROMPT_CHUNK].unsqueeze(1)).squeeze(1)
        out.append(picked - torch.logsumexp(chunk, dim=1))
    return torch.cat(out).tolist() if out else []


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return to_device(rows, like.device)


def _subset(index: torch.Tensor, xb: BlockedRows) -> torch.Tensor | None:
    """index, or None when it is the whole batch in order (cheaper for BlockedRows)."""
    return None if len(index) == xb.x.shape[0] else index


def _top_n_wanted(rows: list[int], params: Sequence[SamplingParams]) -> int:
    return max(params[i].top_n_tokens for i in rows)


def _greedy(xb: BlockedRows, rows: list[int], params: Sequence[SamplingParams]) -> Group:
    """Argmax of the batch rows `rows`."""
    index = _index(rows, xb.x)
    chosen = greedy_rows(xb.x[:, :xb.vocab], _subset(index, xb))
    if chosen is None:
        tokens, lse = xb.argmax(index), xb.log_normalizers(_subset(index, xb))  # [R], [R]
    else:
        tokens, lse = chosen
    logprobs = xb.values(index, tokens.unsqueeze(1)).squeeze(1) - lse
    top = None
    if n := _top_n_wanted(rows, params):
        vals, ids = xb.top_n(index, n)
        top = (vals - lse.unsqueeze(1), ids)
    return rows, tokens, logprobs, top


def _uniform_column(rows: list[int], uniforms: dict[int, float], device) -> torch.Tensor:
    return to_device([uniforms[i] for i in rows], device, torch.float64).unsqueeze(1)


def _pick(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Index where target [R, 1] falls on the cumulative sums cdf [R, W]: the first
    entry above it, but never past the last entry of nonzero mass."""
    pos = torch.searchsorted(cdf, target, right=True)
    return torch.minimum(pos, torch.searchsorted(cdf, cdf[:, -1:].contiguous()))  # [R, 1]


def _draw_dense(xb: BlockedRows, rows: list[int], params: Sequence[SamplingParams],
                uniforms: dict[int, float]) -> Group:
    """Draw from whole rows: pick a block by its mass, then a token inside it."""
    index = _index(rows, xb.x)
    top = xb.top[index].unsqueeze(1)  # [R, 1]
    block_cdf = xb.exp_block_sums(_subset(index, xb)).double().cumsum(dim=1)  # [R, NB]
    total = block_cdf[:, -1:]
    target = _uniform_column(rows, uniforms, xb.x.device) * total  # [R, 1]
    block = _pick(block_cdf, target)  # [R, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inside, _ = xb.gather(index, block)  # [R, BLOCK]
    inside_cdf = (inside - top).exp().cumsum(dim=1, dtype=torch.float64)
    offset = _pick(inside_cdf, (target - before).contiguous())  # [R, 1]
    lse = top + total.log().float()  # [R, 1]
    logprobs = inside.gather(1, offset) - lse
    top_n = None
    if n := _top_n_wanted(rows, params):
        vals, ids = xb.top_n(index, n)
        top_n = (vals - lse, ids)
    return rows, (block * BLOCK + offset).squeeze(1), logprobs.squeeze(1), top_n


def _draw_candidates(vals: torch.Tensor, ids: torch.Tensor, rows: list[int],
                     params: Sequence[SamplingParams], uniforms: dict[int, float]) -> Group:
    """Draw from candidate sets (logits [R, C], ids [R, C]) laid out in vocabulary order."""
    if bool((ids[:, 1:] >= ids[:, :-1]).all()):
        ids_sorted, in_order = ids, vals
    else:
        order = argsort_rows(ids)
        ids_sorted, in_order = ids.gather(1, order), vals.gather(1, order)  # [R, C]
    top = vals.amax(dim=1, keepdim=True)  # [R, 1]
    cdf = exp_rows(in_order - top).cumsum(dim=1, dtype=torch.float64)  # [R, C]
    target = _uniform_column(rows, uniforms, vals.device) * cdf[:, -1:]
    pos = _pick(cdf, target)  # [R, 1]
    lse = top + cdf[:, -1:].log().float()  # [R, 1]
    logprobs = in_order.gather(1, pos) - lse
    top_n = None
    if n := _top_n_wanted(rows, params):
        best = vals.topk(min(n, vals.shape[1]), dim=1)
        top_n = (best.values - lse, ids.gather(1, best.indices))
    return rows, ids_sorted.gather(1, pos).squeeze(1), logprobs.squeeze(1), top_n


def _output(groups: list[Group], params: Sequence[SamplingParams], batch: int) -> SamplerOutput:
    """Lay the groups' results out in batch order."""
    tokens: list[int] = [0] * batch
    logprobs: list[float] = [0.0] * batch
    top: TopTokens = [[] for _ in range(batch)]
    for rows, chosen, chosen_lp, top_n in groups:
        # One copy to the host, not two (token ids are exact in float64).
        chosen_ids, chosen_lps = torch.stack((chosen.double(), chosen_lp.double())).tolist()
        for row, token, lp in zip(rows, chosen_ids, chosen_lps):
            tokens[row], logprobs[row] = int(token), lp
        if top_n is None:
            continue
        for row, row_lps, row_ids in zip(rows, top_n[0].tolist(), top_n[1].tolist()):
            n = params[row].top_n_tokens
            top[row] = [(t, lp) for t, lp in zip(row_ids[:n], row_lps[:n]) if lp != NEG_INF]
    return SamplerOutput(tokens, logprobs, top)
