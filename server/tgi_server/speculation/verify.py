"""Checking drafts: a sequence with d drafts has d + 1 logits rows (its last
known token's, then each draft's). Row i is sampled exactly as decoding
without drafts would sample that position, as if the first i drafts had
been generated: its own penalties, watermark and seeded draw (the draw of
position p depends only on the seed and p). Drafts are accepted while each
equals the token sampled at its position; the first sampled token that
differs (or the one after the last draft) ends the run.

Greedy rows therefore give exactly the argmax decoding. For sampling rows
this is the standard speculative rejection rule for a proposer that drafts
one token with certainty (q = 1 at the draft), as n-gram lookup does: the
draft is accepted with probability p(draft) = min(1, p/q), and a rejected
position keeps the token its draw fell on, which is distributed as p
without the draft, renormalized: the residual max(0, p - q). So every
sampled token, drafted or not, is the very token decoding without drafts
draws with the same seed."""

from collections.abc import Sequence

from ..sequences import ShardSequence


class TokensUpTo(Sequence):
    """tokens[:n] without the copy: what the sampler reads of a row's history
    (its length, its last token, the generated slice for penalties)."""

    __slots__ = ("_tokens", "_n")

    def __init__(self, tokens: list[int], n: int):
        self._tokens, self._n = tokens, n

    def __len__(self) -> int:
        return self._n

    def __iter__(self):
        return iter(self._tokens[:self._n])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._tokens[:self._n][i]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        return self._tokens[i]


def row_contexts(seqs: Sequence[ShardSequence]) -> tuple[list[int], list[int], list[Sequence[int]]]:
    """For the sampling rows of `seqs` (1 + drafts each, in order): the
    sequence of each row (its index in seqs), how many drafts precede the
    row's position, and the tokens before that position."""
    owners: list[int] = []
    depths: list[int] = []
    contexts: list[Sequence[int]] = []
    for i, seq in enumerate(seqs):
        known = len(seq.token_ids) - seq.drafted
        if not seq.drafted:
            owners.append(i)
            depths.append(0)
            contexts.append(seq.token_ids)
            continue
        for extra in range(seq.drafted + 1):
            owners.append(i)
            depths.append(extra)
            contexts.append(TokensUpTo(seq.token_ids, known + extra))
    return owners, depths, contexts


def accepted(seq: ShardSequence, sampled: Sequence[int]) -> int:
    """How many tokens of `sampled` (one per row of seq, 1 + its drafts) the
    sequence keeps: the drafts that equal the token sampled before them, plus
    the token after them."""
    drafts = seq.drafts
    kept = 0
    while kept < seq.drafted and sampled[kept] == drafts[kept]:
        kept += 1
    return kept + 1
