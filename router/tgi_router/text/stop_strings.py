"""Stop strings, checked on the text a sequence streams, token by token.

Two behaviours, one class:

* TGI's (the default, `trim=False`). TGI's shard keeps the text streamed so
  far and, after each token, tests `re.escape(stop) + "$"` against it
  (`StopSequenceCriteria` in server/text_generation_server/utils/tokens.py).
  So a stop string matches across token boundaries, but only when it ends
  where a token's text ends, and Python's `$` also matches before one final
  "\\n" ("foo" stops "…foo\\n"). Nothing is trimmed: every token's text is
  streamed as it comes, stop string included, and the final `generated_text`
  is the decode of all generated tokens, stop string included (TGI issue
  #1724; sub-token stops do not fire, issue #1979). Nothing is held back.
* OpenAI's (`trim=True`): a stop string matches anywhere, even inside one
  token's text; the text before it is emitted, the stop string and anything
  after it are dropped, and the longest suffix that could still begin a stop
  string is held back until it is decided.
"""

from collections.abc import Sequence


class StopStringMatcher:
    """Feed it each token's text; it says what to emit and when a stop hits.

    `feed(text) -> (emit, matched)`: `emit` is the text to stream now,
    `matched` the stop string that ended the sequence, else None. With
    `trim=False` (TGI) `emit` is always `text` itself and `matched` is the
    first stop string, in the order given, that the text so far ends with
    (or ends with plus one "\\n"). With `trim=True` `emit` stops before the
    earliest-completed stop string, and is short of `text` by the suffix held
    back while it might begin a stop string. After a match the matcher is
    done: `feed` returns ("", None) and `flush` "".

    `flush()` ends the stream without a match (EOS, length) and returns the
    held-back text ("" with `trim=False`). Cost per feed: O(longest stop
    string x number of stop strings); memory: the longest stop string.
    """

    def __init__(self, stop: Sequence[str], *, trim: bool = False):
        self.stop: tuple[str, ...] = tuple(stop)
        self.trim = trim
        self._max_len = max((len(s) for s in self.stop), default=0)
        # Proper prefixes of the stop strings: what a held-back suffix may be.
        self._prefixes = frozenset(s[:i] for s in self.stop for i in range(1, len(s)))
        # trim=False: the tail of the text streamed so far, long enough to
        # hold any stop string plus a trailing "\n".
        # trim=True: the held-back text, never yet emitted.
        self._tail = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, str | None]:
        if self.matched is not None:
            return "", None
        if not self.stop:
            return text, None
        return self._feed_trim(text) if self.trim else self._feed_tgi(text)

    def flush(self) -> str:
        held = "" if self.matched is not None or not self.trim else self._tail
        self._tail = ""
        return held

    def _feed_tgi(self, text: str) -> tuple[str, str | None]:
        tail = (self._tail + text)[-(self._max_len + 1):]
        self._tail = tail
        # An empty stop string matches at once, as TGI's regex does; the
        # router's validation is where to refuse it.
        for s in self.stop:
            if tail.endswith(s) or tail.endswith(s + "\n"):
                self.matched = s
                return text, s
        return text, None

    def _feed_trim(self, text: str) -> tuple[str, str | None]:
        buf = self._tail + text
        # The stop string completed first; of two ending together, the longer.
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stop:
            start = buf.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is not None:
            _, start, self.matched = best
            self._tail = ""
            return buf[:start], self.matched
        hold = self._held_suffix(buf)
        self._tail = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], None

    def _held_suffix(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a
        stop string: the most that may still turn into a match."""
        for k in range(min(len(buf), self._max_len - 1), 0, -1):
            if buf[-k:] in self._prefixes:
                return k
        return 0
