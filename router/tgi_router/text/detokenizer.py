"""Streaming detokenization: one generated token in, its finished text out.

Decoding a token on its own is wrong for most tokenizers: byte-level BPE and
SentencePiece byte fallback split one character over several tokens, and
SentencePiece decoders drop or add a leading space depending on what comes
before. So each step decodes a short window (the last emitted tokens plus the
pending ones) twice, with and without the pending tokens, and emits the
difference: the prefix/read offset technique of TGI's `Model.decode_token` and
vLLM's `detokenize_incrementally`. The window is bounded, so a step costs the
same at token 10 and at token 10,000.
"""

from collections.abc import Iterable, Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"
# The last prompt tokens kept as context for the first generated ones (TGI
# starts its prefix offset at `input_length - 5`).
PROMPT_CONTEXT = 5
# Tokens held back at most: a valid UTF-8 character is at most 4 bytes, so text
# still unfinished after this many tokens is invalid, and it is released as is
# rather than let the window (and the cost of a step) grow without bound.
MAX_PENDING = 16


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def special_token_ids(tokenizer) -> frozenset[int]:
    """The ids TGI marks `special: true`: `all_special_ids` of a transformers
    tokenizer, or the added tokens flagged special of a `tokenizers.Tokenizer`;
    empty for any other decoder."""
    ids = getattr(tokenizer, "all_special_ids", None)
    if ids is not None:
        return frozenset(int(i) for i in ids)
    added = getattr(tokenizer, "get_added_tokens_decoder", None)
    if added is not None:
        return frozenset(i for i, tok in added().items() if getattr(tok, "special", False))
    return frozenset()


class IncrementalDetokenizer:
    """Text of one sequence's generated tokens, streamed as tokens arrive.

    `add(token_id)` returns the text that token finishes: possibly "" (a
    character still incomplete, or a token with no text), possibly more than
    the token's own text (it completed characters begun by held-back tokens).
    An incomplete UTF-8 character is never emitted as U+FFFD mid-stream; it is
    held until a later token completes it. `flush()` ends the stream and
    returns whatever is still held back (a genuinely invalid byte sequence then
    comes out as U+FFFD). `text` is everything emitted so far.

    Invariant: the concatenation of every `add` and the final `flush` equals
    `decode(prompt_ids[-5:] + generated)` minus `decode(prompt_ids[-5:])`; for
    byte-level BPE, or an empty prompt, that is `decode(generated)`.

    Text is decoded with `skip_special_tokens=False` by default, as TGI's
    stream tokens are: the EOS token's text ("<|im_end|>") comes out of `add`,
    and `is_special(token_id)` tells the caller to drop it where TGI does (chat
    deltas). TGI's final `generated_text` skips special tokens: build it with
    `decode_generated`, not from `text`.

    Cost per token: two decodes of at most ~2 x MAX_PENDING tokens.
    """

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = False, special_ids: Iterable[int] | None = None):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._special = (frozenset(special_ids) if special_ids is not None
                         else special_token_ids(tokenizer))
        # The window: ids[:read] were emitted already and are only context
        # (their text is `context_text`), ids[read:] are pending. Older ids
        # are dropped, which keeps the window bounded.
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT:])
        self._read = len(self._ids)
        self._context_text = self._decode(self._ids)
        self._chunks: list[str] = []
        self._finished = False

    @property
    def text(self) -> str:
        """All generated text emitted so far (by `add` and `flush`)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def is_special(self, token_id: int) -> bool:
        """TGI's `special` flag of a stream token."""
        return token_id in self._special

    def add(self, token_id: int) -> str:
        """Append one generated token; returns the newly finished text."""
        if self._finished:
            raise RuntimeError("add() after flush()")
        self._ids.append(int(token_id))
        new_text = self._decode(self._ids)
        # Text ending in U+FFFD may be a character whose remaining bytes are
        # still to come: hold it (unless the window is full, see MAX_PENDING).
        done = len(new_text) > len(self._context_text) and not new_text.endswith(REPLACEMENT)
        if not done and len(self._ids) - self._read < MAX_PENDING:
            return ""
        return self._emit(new_text)

    def flush(self) -> str:
        """End of stream: the held-back text, invalid bytes as U+FFFD."""
        if self._finished:
            return ""
        self._finished = True
        if self._read == len(self._ids):
            return ""
        return self._emit(self._decode(self._ids))

    def _emit(self, new_text: str) -> str:
        chunk = new_text[len(self._context_text):]
        # The pending tokens become the next step's context.
        del self._ids[:self._read]
        self._read = len(self._ids)
        self._context_text = self._decode(self._ids)
        if chunk:
            self._chunks.append(chunk)
        return chunk

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""


def decode_generated(tokenizer: Decoder, prompt_ids: Sequence[int], generated_ids: Sequence[int],
                     skip_special_tokens: bool = True) -> str:
    """The final `generated_text` as TGI computes it when a sequence stops:
    the generated ids decoded with special tokens skipped, with the last
    prompt token as context so a SentencePiece leading space is kept.
    O(len(generated_ids)): call once per finished sequence."""
    context = list(prompt_ids[-1:])
    prefix = tokenizer.decode(context, skip_special_tokens=skip_special_tokens) if context else ""
    full = tokenizer.decode(context + list(generated_ids), skip_special_tokens=skip_special_tokens)
    return full[len(prefix):]
