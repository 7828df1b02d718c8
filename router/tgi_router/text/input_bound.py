"""How many characters one token can cover, read from a tokenizer's JSON, so
that an input too long for --max-input-tokens is refused before it is
tokenized (tokenizing 2 MB takes seconds of CPU; the refusal takes none).

The bound is sound, not a guess: a text of `c` characters encodes to at
least `c / max_chars_per_token` tokens whenever every character of the
input ends up inside some token. That holds for the tokenizers LLMs use
(byte-level BPE, SentencePiece-style BPE or Unigram with byte fallback,
WordPiece) with normalizers and pre-tokenizers that keep every character.
A tokenizer that may drop characters (BERT's control-character cleaning,
whitespace splitting, `Strip`) or fuse a run of unknown characters into one
token gets no bound (`None`): its inputs are bounded by --payload-limit only.
"""

import json

__all__ = ["max_chars_per_token"]

# Normalizers that keep every character; NFC/NFKC may compose a few
# characters into one (a Hangul syllable from 3 jamo, a base letter with
# its marks), which _COMPOSE_FACTOR covers. SentencePiece's `Precompiled`
# map drops control characters: not here.
_KEEPING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend", "Replace", "NFC", "NFKC"}
_COMPOSING = {"NFC", "NFKC"}
_COMPOSE_FACTOR = 4
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


def max_chars_per_token(tokenizer_json: str) -> int | None:
    """An upper bound on the input characters one token covers, or None
    when this tokenizer admits no such bound (see the module docstring)."""
    try:
        spec = json.loads(tokenizer_json)
        model = spec["model"]
    except (ValueError, KeyError, TypeError):
        return None
    longest = _longest_piece(model)
    if longest is None:
        return None
    added = [len(t.get("content", "")) for t in spec.get("added_tokens") or ()]
    longest = max([longest, *added])
    factor = _normalizer_factor(spec.get("normalizer"))
    if factor is None or not _keeps_characters(spec.get("pre_tokenizer")):
        return None
    return max(1, longest) * factor


def _longest_piece(model: dict) -> int | None:
    kind, vocab = model.get("type"), model.get("vocab")
    if kind == "BPE" and isinstance(vocab, dict):
        fused_unknowns = model.get("fuse_unk") and model.get("unk_token") and not model.get("byte_fallback")
        return None if fused_unknowns else max(map(len, vocab), default=1)
    if kind == "Unigram" and isinstance(vocab, list) and model.get("byte_fallback"):
        return max((len(piece) for piece, _ in vocab), default=1)
    if kind == "WordPiece" and isinstance(vocab, dict):
        # A word longer than this becomes one [UNK].
        return max(max(map(len, vocab), default=1), int(model.get("max_input_chars_per_word", 100)))
    return None


def _normalizer_factor(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factors = [_normalizer_factor(n) for n in normalizer.get("normalizers", ())]
        return None if None in factors else max(factors, default=1)
    if kind == "Replace" and not normalizer.get("content"):
        return None  # replacing with nothing deletes
    if kind not in _KEEPING_NORMALIZERS:
        return None
    return _COMPOSE_FACTOR if kind in _COMPOSING else 1


def _keeps_characters(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(p) for p in pre_tokenizer.get("pretokenizers", ()))
    if kind == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS
