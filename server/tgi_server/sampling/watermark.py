"""The green-list watermark of Kirchenbauer et al. ("A Watermark for Large
Language Models", 2023), as TGI applies it, and its detector.

Before each token is chosen, the previous token seeds a permutation of the
vocabulary (torch's CPU generator seeded with HASH_KEY * previous token, as
TGI and the paper's reference code seed it); its first gamma share is the
green list, whose logits get + delta. Text written that way holds more
green tokens than the gamma share chance gives; the detector counts them and
reports the z-score of that count.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

HASH_KEY = 15485863  # the reference implementation's (a prime), TGI's too
_CACHED_LISTS = 256  # green lists kept (each gamma * V int32: 98 KB for a 49k vocabulary)


@dataclass(frozen=True)
class Watermark:
    """gamma: the green share of the vocabulary; delta: the bias added to
    green logits (--watermark-gamma / --watermark-delta, TGI's defaults)."""

    gamma: float = 0.5
    delta: float = 2.0

    def __post_init__(self):
        # One cache per instance: a green list depends on (gamma, previous token, vocabulary).
        object.__setattr__(self, "_lists", functools.lru_cache(maxsize=_CACHED_LISTS)(self._draw))

    def green_list(self, previous: int, vocab: int) -> torch.Tensor:
        """The green token ids [int(vocab * gamma)] (int64, CPU) after token `previous`."""
        return self._lists(previous, vocab)

    def _draw(self, previous: int, vocab: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(HASH_KEY * previous)
        return torch.randperm(vocab, generator=generator)[:int(vocab * self.gamma)]

    def apply(self, logits: torch.Tensor, rows: Sequence[int], previous: Sequence[int], vocab: int) -> None:
        """Add delta to the green logits of batch rows `rows` of contiguous
        logits [B, W] (W >= vocab) in place; previous[j]: row rows[j]'s last token."""
        if not rows:
            return
        width = logits.shape[1]
        where = torch.cat([self.green_list(p, vocab) + row * width for row, p in zip(rows, previous)])
        logits.view(-1)[where.to(logits.device)] += self.delta

    def z_score(self, token_ids: Sequence[int], vocab: int) -> tuple[float, int, int]:
        """(z, green, scored) for a token sequence: each token after the first
        is scored against the green list of the one before it, each distinct
        (previous, token) pair once, so that a phrase repeated in a loop
        counts once (as the reference detector's ignore_repeated_ngrams);
        z = (green - gamma n) / sqrt(n gamma (1 - gamma)), 0 for n = 0."""
        pairs = dict.fromkeys(zip(token_ids, token_ids[1:]))
        green = sum(1 for previous, token in pairs if self._is_green(previous, token, vocab))
        n = len(pairs)
        if n == 0:
            return 0.0, 0, 0
        z = (green - self.gamma * n) / math.sqrt(n * self.gamma * (1 - self.gamma))
        return z, green, n

    def _is_green(self, previous: int, token: int, vocab: int) -> bool:
        return 0 <= token < vocab and bool((self.green_list(previous, vocab) == token).any())
