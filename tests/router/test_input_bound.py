"""Inputs too long for max_input_tokens are refused from their length alone,
before any tokenization, with a bound that never refuses a fitting input."""

import json
import random

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from tgi_router.errors import ValidationError
from tgi_router.request.protocol import GenerateRequest
from tgi_router.request.validation import ValidationLimits, validate
from tgi_router.text.input_bound import max_chars_per_token

from .conftest import byte_level_tokenizer


def test_byte_level_bpe_is_bounded_by_its_longest_token():
    tok = byte_level_tokenizer()
    assert max_chars_per_token(tok.to_str()) == len("</s>")


def test_the_bound_holds_on_text_that_packs_many_characters_per_token():
    vocab = {"a": 0, "aa": 1, "aaaa": 2, "aaaaaaaa": 3, "b": 4}
    merges = [("a", "a"), ("aa", "aa"), ("aaaa", "aaaa")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bound = max_chars_per_token(tok.to_str())
    assert bound == 8
    for text in ("a" * 1000, "ab" * 300, "aaaaaaaab" * 50):
        assert len(tok.encode(text).ids) >= len(text) / bound


@pytest.mark.parametrize("setup", [
    lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Whitespace()),        # drops spaces
    lambda t: setattr(t, "normalizer", normalizers.Strip()),                   # drops edges
    lambda t: setattr(t, "normalizer", normalizers.BertNormalizer()),          # drops control characters
    lambda t: setattr(t, "normalizer", normalizers.Replace(" ", "")),          # deletes
])
def test_tokenizers_that_may_drop_characters_get_no_bound(setup):
    tok = byte_level_tokenizer()
    setup(tok)
    assert max_chars_per_token(tok.to_str()) is None


def test_fused_unknowns_and_garbage_get_no_bound():
    tok = Tokenizer(models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>", fuse_unk=True))
    assert max_chars_per_token(tok.to_str()) is None
    assert max_chars_per_token("not json") is None
    assert max_chars_per_token(json.dumps({"model": {"type": "WordLevel", "vocab": {"a": 0}}})) is None


def test_composing_normalizers_widen_the_bound():
    tok = byte_level_tokenizer()
    tok.normalizer = normalizers.NFC()
    assert max_chars_per_token(tok.to_str()) == 4 * len("</s>")


LIMITS = ValidationLimits(max_input_tokens=10, max_total_tokens=20, max_input_chars=40)


def never_called(text: str) -> list[int]:
    raise AssertionError("tokenized")


def test_an_input_past_max_input_chars_is_refused_without_tokenizing():
    request = GenerateRequest.model_validate({"inputs": "x" * 41, "parameters": {"max_new_tokens": 1}})
    with pytest.raises(ValidationError) as info:
        validate(request, never_called, LIMITS, rng=random.Random(0))
    assert info.value.detail == "`inputs` must have less than 10 tokens. Given: at least 11"


def test_inputs_within_the_bound_and_truncated_inputs_are_tokenized():
    fits = GenerateRequest.model_validate({"inputs": "x" * 40, "parameters": {"max_new_tokens": 1}})
    with pytest.raises(ValidationError, match="tokenizer error tokenized"):
        validate(fits, never_called, LIMITS, rng=random.Random(0))
    # With truncate a long input is legal (TGI keeps its last `truncate` tokens).
    long = GenerateRequest.model_validate({"inputs": "x" * 400, "parameters": {"max_new_tokens": 1, "truncate": 5}})
    valid = validate(long, lambda s: [ord(c) for c in s], LIMITS, rng=random.Random(0))
    assert valid.input_length == 5
