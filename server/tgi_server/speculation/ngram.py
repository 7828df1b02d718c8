"""Prompt-lookup drafting: the longest recent suffix of a sequence that also
occurs earlier in it (prompt or output) proposes the tokens that followed
that earlier occurrence.

The index maps every n-gram (MIN_N <= n <= MAX_N) to the end of its latest
occurrence, and is kept up to date as tokens are appended: each new token
adds MAX_N - MIN_N + 1 entries, so a proposal costs O(1) amortized per token
and never rescans the sequence. An n-gram enters the index one token late
(once a later token exists), so a lookup of the current suffix finds an
earlier occurrence, never the suffix itself."""

from collections.abc import Sequence

MAX_N = 4  # longest suffix looked up; longer matches predict copies best
MIN_N = 2  # a single repeated token predicts little (acceptance near the base rate)


class NgramIndex:
    """The n-gram index of one growing token sequence."""

    def __init__(self, max_n: int = MAX_N, min_n: int = MIN_N):
        self.max_n, self.min_n = max_n, min_n
        self._last_end: dict[tuple[int, ...], int] = {}  # n-gram -> index of its last token
        self._indexed = 0  # tokens[:_indexed] have had their n-grams (ending there) added

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens to draft after `tokens` (the sequence so far: the
        same list, only ever appended to, on every call); [] when no suffix
        of MIN_N or more tokens occurred before."""
        self._catch_up(tokens)
        last = len(tokens) - 1
        if k <= 0 or last < self.min_n:
            return []
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            end = self._last_end.get(tuple(tokens[last - n + 1:]))
            if end is not None:
                return list(tokens[end + 1:end + 1 + k])
        return []

    def _catch_up(self, tokens: Sequence[int]) -> None:
        """Adds the n-grams ending at every index below the last one."""
        table = self._last_end
        for end in range(self._indexed, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                table[tuple(tokens[end - n + 1:end + 1])] = end
        self._indexed = max(self._indexed, len(tokens) - 1)
