"""Rank 0's answer to a step: each sampling sequence's tokens (with drafts,
the drafts kept and the token after them), their logprobs and top-n
alternatives, and prompt logprobs where asked."""

import math

import torch

from tgi_proto import pb

from .batch import StepBatch
from .sampling.grammar import GrammarCompiler
from .sampling.sampler import Sampler, prompt_logprobs
from .sequences import ShardSequence
from .speculation.verify import accepted, row_contexts


def generations(batch: StepBatch, logits: torch.Tensor, sampler: Sampler | None,
                grammars: GrammarCompiler | None) -> dict[int, pb.Generation]:
    """logits [S, vocab] float32 of batch.logits_rows -> a Generation per
    sequence of the batch; sets each sampling sequence's `sampled`. Without
    a sampler (tensor-parallel ranks > 0, whose tokens nobody reads) only
    each sequence's computed-token count."""
    out = {s.id: pb.Generation(id=s.id, num_computed_tokens=s.num_computed + s.scheduled) for s in batch.seqs}
    if sampler is None:
        return out
    if batch.sampling_seqs:
        _sample(batch, logits, sampler, grammars, out)
    for seq, first, count in batch.prompt_rows:
        out[seq.id].prefill_tokens.extend(_prompt_tokens(seq, logits[first:first + count]))
    return out


def _sample(batch: StepBatch, logits: torch.Tensor, sampler: Sampler, grammars: GrammarCompiler | None,
            out: dict[int, pb.Generation]) -> None:
    sampling = batch.sampling_seqs
    # Rows to sample: one per sampling sequence, 1 + d for one with d drafts (row i after the first i drafts).
    owners, depths, contexts = row_contexts(sampling)
    rows = batch.sample_rows
    if len(owners) > len(sampling):
        rows = [rows[i] + depth for i, depth in zip(owners, depths)]
    # Usually every logits row samples: skip a copy of [S, vocab].
    sample_logits = logits if rows == list(range(logits.shape[0])) else logits[rows]
    # A sequence has a grammar only when `grammars` compiled it; a row after
    # drafts is masked as the grammar stands after them.
    constrained = [j for j, i in enumerate(owners) if sampling[i].grammar is not None]
    mask = None
    if constrained:
        mask = grammars.mask(constrained, [sampling[owners[j]].grammar for j in constrained],
                             [sampling[owners[j]].drafts[:depths[j]] for j in constrained])
    result = sampler(sample_logits, [sampling[i].params for i in owners], contexts,
                     [sampling[i].prompt_length for i in owners], [mask] if mask else [])
    if mask is not None:
        for j, token in zip(constrained, grammars.settle(mask, [result.token_ids[j] for j in constrained])):
            if token != result.token_ids[j]:
                # A budget replaced the draw (rare, see grammar_budget.py): the
                # replacement's logprob is under the model's own logits, before
                # penalties, mask and warpers (the sampler leaves them untouched).
                result.token_ids[j] = token
                result.logprobs[j] = torch.log_softmax(sample_logits[j].float(), -1)[token].item()
    firsts, kept = [], []
    first = 0
    for seq in sampling:
        firsts.append(first)
        kept.append(accepted(seq, result.token_ids[first:first + 1 + seq.drafted]) if seq.drafted else 1)
        first += 1 + seq.drafted
    if mask is not None:
        grammars.consume([(seq.grammar, t) for seq, f, k in zip(sampling, firsts, kept) if seq.grammar is not None
                          for t in result.token_ids[f:f + k]])
    for seq, first, k in zip(sampling, firsts, kept):
        gen = out[seq.id]
        gen.sampled = True
        gen.num_drafted = seq.drafted
        # The known tokens computed and the accepted drafts.
        gen.num_computed_tokens = seq.num_computed + seq.scheduled - seq.drafted + k - 1
        for j in range(first, first + k):
            top = (pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in result.top_tokens[j])
            if j == first:
                gen.token_id, gen.logprob = result.token_ids[j], result.logprobs[j]
                gen.top_tokens.extend(top)
            else:
                gen.next_tokens.append(pb.NextToken(token_id=result.token_ids[j], logprob=result.logprobs[j],
                                                    top_tokens=top))
        gen.grammar_complete = seq.grammar is not None and seq.grammar.complete
        # They replace the drafts in token_ids at the sequence's next step.
        seq.sampled = result.token_ids[first:first + k]


def _prompt_tokens(seq: ShardSequence, logits: torch.Tensor) -> list[pb.TokenLogprob]:
    """Logits rows [n, vocab] at positions start..start+n-1 predict prompt
    tokens start+1..; the sequence's first token has no logprob (NaN)."""
    start = seq.num_computed
    last = min(start + logits.shape[0], seq.prompt_length - 1)  # last predicted index
    tokens = []
    if start == 0:
        tokens.append(pb.TokenLogprob(token_id=seq.token_ids[0], logprob=math.nan))
    targets = seq.token_ids[start + 1:last + 1]
    if targets:
        lps = prompt_logprobs(logits[:len(targets)], torch.tensor(targets, device=logits.device))
        tokens.extend(pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in zip(targets, lps))
    return tokens
