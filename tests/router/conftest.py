"""Fixtures shared by the router's tests: a byte-level tokenizer (one token
per UTF-8 byte, <s>=256, </s>=257) and a check of what a grammar admits."""

import pytest
from llguidance import LLMatcher, LLTokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

BOS, EOS = 256, 257


def byte_level_tokenizer() -> Tokenizer:
    """A BPE over the 256 bytes (no merges) plus <s>=256 and </s>=257."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet, key=ord))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


@pytest.fixture(scope="session")
def accepts():
    """accepts(grammar_text, text): the grammar admits `text` as a complete answer."""
    tok = byte_level_tokenizer()
    lltok = LLTokenizer(tok.to_str(), n_vocab=EOS + 1, eos_token=[EOS])

    def check(grammar_text: str, text: str) -> bool:
        matcher = LLMatcher(lltok, grammar_text, log_level=0)
        ok = matcher.consume_tokens(tok.encode(text, add_special_tokens=False).ids)
        return ok and not matcher.is_error() and matcher.is_accepting()
    return check
