"""Short completions of a grammar from any point, found by walking llguidance's
own matcher over single bytes.

Router and shard share this: the router refuses (422) a constrained request
whose max_new_tokens cannot hold the shortest valid output, the shard keeps
every constrained sequence able to finish within what remains of its budget.
Both must compute the same lengths, so both use this module.

A matcher compiled against a 257-token vocabulary (the 256 bytes and an end
token) answers which bytes may come next in a few microseconds, and forced
runs (`compute_ff_bytes`) advance in one move. Matcher states are opaque, so
a walk cannot recognise a state it has seen; three rules keep it small:

- Siblings that leave the matcher with the same next-byte mask and forced
  run are one move (all letters inside a free string), and only a few
  representatives of each character class are tried when many are allowed.
- A move back to a (mask, JSON position) already on the path is a loop (one
  more letter, digit or escape at the same key or item) and costs a penalty
  that outweighs any length, unless every move from there loops (a counted
  repetition such as `[0-9]{5}` or a minLength). A JSON position names the
  key or item index of every open container, so a required key or a
  minItems item is progress, not a loop.
- For JSON grammars the number of open strings and containers, each of
  which needs a closing byte, is an admissible estimate of what remains.

`WalkState.shortest` first dives greedily (at each step the move that loops
least, leaves fewest closers and may end soonest): a few milliseconds even
for a 370-byte completion, what the shard runs per step. Given a node budget
it then searches best-first, pruned at the dive's length, for a shorter one:
what the router and the shard run once per grammar for its minimum. The
result is the shortest among completions with the fewest loops when the
search finishes (it did for every schema, pattern and tool set tested), a
valid completion always.
"""

import functools
import heapq
import itertools
import json

import llguidance as llg

__all__ = ["GrammarWalk", "WalkState", "is_json_grammar", "walk"]

_EOS = 256
_ASCII = (1 << 128) - 1
_BYTES = (1 << 256) - 1
_LOOP = 1000  # a loop's cost: more than any completion's length in bytes


def _bits(chars: str) -> int:
    return sum(1 << ord(c) for c in chars)


# Bytes tried whenever allowed (JSON's structure, and the shortest values),
# then the lowest allowed byte of each remaining class.
_STRUCTURE = _bits('"{}[],:-. 0')
_CLASSES = (_bits("123456789"), _bits("abcdefghijklmnopqrstuvwxyz"), _bits("ABCDEFGHIJKLMNOPQRSTUVWXYZ"),
            sum(1 << i for i in range(32, 127)) & ~_bits(
                "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") & ~_STRUCTURE)
_FEW = 12  # at most this many allowed ASCII bytes: try them all
_ENDERS = _bits(',}]"') | 1 << _EOS


class _ByteVocabulary:
    """What llguidance's TokenizerWrapper reads: token i is byte i, 256 ends."""
    eos_token_id = _EOS
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<end>"]
    special_token_ids = [_EOS]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@functools.cache
def _byte_tokenizer() -> llg.LLTokenizer:
    return llg.LLTokenizer(llg.TokenizerWrapper(_ByteVocabulary()), slices=[])


def is_json_grammar(grammar: str) -> bool:
    """Whether llguidance's grammar text is one JSON Schema (as the router
    builds for `json` grammars, response formats and required tool calls)."""
    try:
        grammars = json.loads(grammar)["grammars"]
    except (ValueError, KeyError, TypeError):
        return False
    return len(grammars) == 1 and grammars[0].get("json_schema") is not None


class _JsonShape:
    """Where a JSON text stands: the open containers, each with the key or
    the item index it is writing, and whether a string is open. Immutable.
    Two states of the walk at the same place are a loop (more of the same);
    at another key or item they are progress (a required key, a minItems)."""
    __slots__ = ("stack", "string", "escape", "text", "last")

    def __init__(self, stack: tuple = (), string: bool = False, escape: bool = False,
                 text: bytes = b"", last: bytes = b""):
        self.stack = stack      # (("{", key bytes) or ("[", item index), ...) as byte values
        self.string = string
        self.escape = escape
        self.text = text        # the open string's first 32 bytes
        self.last = last        # the last closed string (a key, once ':' follows)

    def fed(self, data: bytes) -> "_JsonShape":
        stack, string, escape, text, last = self.stack, self.string, self.escape, self.text, self.last
        for b in data:
            if string:
                if escape:
                    escape = False
                elif b == 0x5C:
                    escape = True
                elif b == 0x22:
                    string, last = False, text
                    continue
                if len(text) < 32:
                    text += bytes([b])
            elif b == 0x22:
                string, text = True, b""
            elif b == 0x7B:
                stack += ((b, b""),)
            elif b == 0x5B:
                stack += ((b, 0),)
            elif b in (0x7D, 0x5D):
                stack = stack[:-1]
            elif b == 0x3A and stack:
                stack = stack[:-1] + ((stack[-1][0], last),)
            elif b == 0x2C and stack and stack[-1][0] == 0x5B:
                stack = stack[:-1] + ((0x5B, stack[-1][1] + 1),)
        return _JsonShape(stack, string, escape, text, last)

    def closers(self) -> int:
        """Bytes any completion needs at least: one per open string and container."""
        return len(self.stack) + self.string


class WalkState:
    """A position in a grammar, advanced by bytes; `shortest()` completes it."""

    def __init__(self, matcher: llg.LLMatcher, shape: _JsonShape | None):
        self.matcher = matcher
        self.shape = shape

    def copy(self) -> "WalkState":
        return WalkState(self.matcher.deep_copy(), self.shape)

    def advance(self, data: bytes) -> bool:
        """Consumes `data`; False (and the state is unusable) when the grammar forbids it."""
        if data and not self.matcher.consume_tokens(list(data)):
            return False
        if self.shape is not None:
            self.shape = self.shape.fed(data)
        return True

    def accepting(self) -> bool:
        return self.matcher.is_accepting()

    def completes(self, tail: bytes) -> bool:
        """Whether `tail` is a complete continuation from here."""
        m = self.matcher.deep_copy()
        return m.consume_tokens(list(tail)) and m.is_accepting()

    def shortest(self, max_nodes: int = 0) -> bytes | None:
        """A shortest completion (b"" when already complete; see the module's
        doc for which), or None when none was found.

        First a greedy dive (the cheapest-looking move at every step) gives a
        completion; then a best-first search, pruned at that length, looks
        for a shorter one within `max_nodes` expansions (0: the dive alone)."""
        best, bound = self._dive()
        order = itertools.count()
        heap = [(self.shape.closers() if self.shape else 0, 0, next(order), self.matcher, b"", self.shape, 0,
                 frozenset())]
        for _ in range(max_nodes):
            if not heap or heap[0][0] >= bound:
                break
            cost, _, _, matcher, path, shape, loops, seen = heapq.heappop(heap)
            if matcher.is_accepting():
                return path
            seen_here, moves = _moves(matcher, shape, seen)
            for child, step, child_shape, loop in moves:
                length = len(path) + len(step)
                cost = length + (child_shape.closers() if child_shape else 0) + _LOOP * (loops + loop)
                heapq.heappush(heap, (cost, -length, next(order), child, path + step, child_shape,
                                      loops + loop, seen_here))
        return best

    def _dive(self, max_steps: int = 4096) -> tuple[bytes | None, float]:
        """(a completion, its cost as the search counts it) by always taking the
        move that loops least, leaves fewest closers and may end soonest
        (forced runs are free here: they are the same on every path);
        (None, inf) when it finds none."""
        matcher, shape, path, seen, loops = self.matcher, self.shape, b"", frozenset(), 0
        for _ in range(max_steps):
            if matcher.is_accepting():
                return path, len(path) + _LOOP * loops
            seen, moves = _moves(matcher, shape, seen)
            if not moves:
                break
            matcher, step, shape, loop = min(moves, key=lambda m: (
                m[3], shape.fed(m[1][:1]).closers() if shape else 0, not _ends_soon(m[0]), len(m[1])))
            path, loops = path + step, loops + loop
        return None, float("inf")


def _ends_soon(matcher: llg.LLMatcher) -> bool:
    """Whether the next byte may end a value (or the whole text)."""
    mask = int.from_bytes(matcher.compute_bitmask(), "little")
    return bool(mask & _ENDERS)


def _moves(matcher: llg.LLMatcher, shape: _JsonShape | None, seen: frozenset) -> tuple[frozenset, list]:
    """(`seen` plus this state's key, the distinct one-byte moves (plus their
    forced runs) from `matcher`: (matcher after, bytes, shape after, 1 if a
    penalised loop else 0))."""
    raw = matcher.compute_bitmask()  # 257 bits: bytes, then the end token
    mask = int.from_bytes(raw, "little")
    seen = seen | {(raw, shape.stack if shape else None)}
    moves, distinct = [], set()
    for b in _candidates(mask):
        child = matcher.deep_copy()
        child.consume_token(b)
        forced = child.compute_ff_bytes()
        if forced:
            child.consume_tokens(list(forced))
        child_raw = child.compute_bitmask()
        if (child_raw, forced) in distinct:
            continue
        distinct.add((child_raw, forced))
        step = bytes([b]) + forced
        child_shape = shape.fed(step) if shape is not None else None
        loop = (child_raw, child_shape.stack if child_shape else None) in seen
        moves.append((child, step, child_shape, loop))
    penalise = not all(loop for *_, loop in moves)
    return seen, [(c, s, sh, int(loop and penalise)) for c, s, sh, loop in moves]


def _candidates(mask: int) -> list[int]:
    """The allowed bytes worth trying, lowest first: ASCII when any is allowed
    (a non-ASCII character costs two to four bytes), all of them when few."""
    allowed = mask & _ASCII
    if not allowed:
        allowed = mask & _BYTES
        allowed &= -allowed  # the lowest lead byte: any character will do
    elif allowed.bit_count() > _FEW:
        picked = allowed & _STRUCTURE
        for cls in _CLASSES:
            x = allowed & cls
            picked |= x & -x
        allowed = picked
    out = []
    while allowed:
        low = allowed & -allowed
        out.append(low.bit_length() - 1)
        allowed ^= low
    return out


class GrammarWalk:
    """One grammar compiled against the byte vocabulary: the start of every walk."""

    def __init__(self, grammar: str):
        """Raises ValueError when llguidance cannot compile `grammar`."""
        self._template = llg.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
        if self._template.is_error():
            raise ValueError(self._template.get_error())
        self._json = is_json_grammar(grammar)
        self._shortest: bytes | None | bool = False  # False: not computed yet

    def start(self) -> WalkState:
        return WalkState(self._template.deep_copy(), _JsonShape() if self._json else None)

    def shortest(self) -> bytes | None:
        """The shortest complete output (computed once; None when the walk
        found none within its budget)."""
        if self._shortest is False:
            self._shortest = self.start().shortest(max_nodes=400)
        return self._shortest


@functools.lru_cache(maxsize=256)
def walk(grammar: str) -> GrammarWalk:
    """The cached GrammarWalk of `grammar`."""
    return GrammarWalk(grammar)
