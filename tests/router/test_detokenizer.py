"""Streaming detokenizer: the text streamed token by token is the text a
whole decode gives, with no U+FFFD for a character split over tokens,
decoding a bounded window per token (`make bench BENCH=detokenize` times it)."""

import subprocess
import sys

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from tgi_router.text.detokenizer import MAX_PENDING, IncrementalDetokenizer, decode_generated

TEXTS = [
    "Hello, world! How are you today? I'm fine -- thanks.",
    "def f(x):\n    if x > 0:\n        return x * 2\n\treturn -x  # done\n\n",
    "Llamas 🦙 and rockets 🚀; family 👨‍👩‍👧 and flags 🇫🇷!",
    "中文文本测试，日本語のテキスト、한국어 텍스트。",
    "Ça va? Crème brûlée, naïve café, e\u0301 (combining), Ωμέγα, مرحبا.",
    "mixed: x=42 → y≈3.14 ✓ «quoted» 🦙中 é\n  - item\n",
]
REPLACEMENT = "\ufffd"


def byte_level_tokenizer() -> Tokenizer:
    """GPT-2 style byte-level BPE with no merges: every UTF-8 byte is its own
    token, so "é" takes 2 tokens, "中" 3 and "🦙" 4."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return tok


def sentencepiece_tokenizer() -> Tokenizer:
    """Llama-2 style: "▁" for spaces, byte fallback for anything not in the
    vocabulary, and a decoder that strips the text's leading space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyzHTW.,!?()\n:", "▁h", "▁he", "▁w", "▁wo"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "h"), ("▁h", "e"), ("▁", "w"), ("▁w", "o")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["</s>"])
    return tok


@pytest.fixture(scope="module")
def smollm2():
    from tgi_server.weights.gguf import load_gguf_tokenizer
    from tgi_server.weights.resolve import default_model_path
    return load_gguf_tokenizer(default_model_path())


def stream(tok, prompt_ids, ids, **kw) -> tuple[list[str], str, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, prompt_ids, **kw)
    chunks = [detok.add(i) for i in ids]
    return chunks, detok.flush(), detok


def encode(tok, text) -> list[int]:
    if isinstance(tok, Tokenizer):
        return tok.encode(text, add_special_tokens=False).ids
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_stream_equals_whole_decode(smollm2, text):
    prompt = encode(smollm2, "<|im_start|>assistant\n")
    ids = encode(smollm2, text)
    chunks, tail, detok = stream(smollm2, prompt, ids)
    assert "".join(chunks) + tail == smollm2.decode(ids) == text
    assert detok.text == text
    assert not any(REPLACEMENT in c for c in chunks)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("build", [byte_level_tokenizer, sentencepiece_tokenizer])
def test_tiny_tokenizers_stream_equals_whole_decode(build, text):
    tok = build()
    ids = encode(tok, text)
    chunks, tail, _ = stream(tok, [], ids)
    assert "".join(chunks) + tail == tok.decode(ids, skip_special_tokens=False)
    assert not any(REPLACEMENT in c for c in chunks) and tail == ""


def test_smollm2_emoji_split_over_three_tokens_is_held_then_emitted_whole(smollm2):
    ids = encode(smollm2, "a 🦙")
    assert len(ids) == 4  # "a", " \xf0\x9f", "\xa6", "\x99"
    chunks, tail, _ = stream(smollm2, [], ids)
    assert chunks == ["a", "", "", " 🦙"] and tail == ""


def test_every_byte_its_own_token_emits_whole_characters():
    tok = byte_level_tokenizer()
    text = "é中🦙"
    chunks, _, _ = stream(tok, [], encode(tok, text))
    assert len(chunks) == 2 + 3 + 4
    assert [c for c in chunks if c] == ["é", "中", "🦙"]


def test_byte_fallback_keeps_leading_space_of_first_generated_token_with_prompt():
    tok = sentencepiece_tokenizer()
    prompt, gen = encode(tok, "hello"), encode(tok, "world ça")  # "▁wo" …
    chunks, tail, _ = stream(tok, prompt, gen)
    whole = tok.decode(prompt + gen)
    assert "".join(chunks) + tail == whole[len(tok.decode(prompt)):] == " world ça"


def test_byte_fallback_without_prompt_matches_decode_of_generated_ids():
    tok = sentencepiece_tokenizer()
    gen = encode(tok, "hello world")
    chunks, _, _ = stream(tok, [], gen)
    assert "".join(chunks) == tok.decode(gen) == "hello world"
    assert chunks[0] == "hello"[:len(chunks[0])]  # no leading space


def test_incomplete_character_at_the_end_comes_out_of_flush_as_replacement():
    tok = byte_level_tokenizer()
    lead = encode(tok, "中")[0]  # the first of three bytes
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in encode(tok, "ok")] == ["o", "k"]
    assert detok.add(lead) == ""
    assert detok.flush() == REPLACEMENT
    assert detok.text == "ok" + REPLACEMENT


def test_invalid_byte_followed_by_text_is_emitted_as_replacement():
    tok = byte_level_tokenizer()
    continuation = encode(tok, "中")[1]  # a byte that cannot start a character
    chunks, tail, _ = stream(tok, [], [continuation, *encode(tok, "ab")])
    assert "".join(chunks) + tail == REPLACEMENT + "ab"


def test_special_token_text_is_streamed_and_flagged(smollm2):
    eos = smollm2.convert_tokens_to_ids("<|im_end|>")
    ids = encode(smollm2, "Hi there.") + [eos]
    detok = IncrementalDetokenizer(smollm2, encode(smollm2, "<|im_start|>assistant\n"))
    chunks = [detok.add(i) for i in ids]
    assert chunks[-1] == "<|im_end|>"
    assert detok.is_special(eos) and not detok.is_special(ids[0])


def test_special_tokens_skipped_when_asked():
    tok = byte_level_tokenizer()
    eos = tok.token_to_id("<eos>")
    chunks, tail, detok = stream(tok, [], [*encode(tok, "ab"), eos], skip_special_tokens=True)
    assert "".join(chunks) + tail == "ab"
    assert detok.is_special(eos)


def test_decode_generated_skips_special_tokens_and_keeps_leading_space():
    tok = sentencepiece_tokenizer()
    prompt, gen = encode(tok, "hello"), [*encode(tok, "world"), tok.token_to_id("</s>")]
    assert decode_generated(tok, prompt, gen) == " world"


class CountingDecoder:
    """Wraps a tokenizer and records how many ids each decode call saw."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, skip_special_tokens=False):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_window_stays_bounded_over_a_long_stream(smollm2):
    counting = CountingDecoder(smollm2)
    ids = encode(smollm2, " ".join(TEXTS) * 20)
    chunks, tail, _ = stream(counting, encode(smollm2, "a prompt of some length " * 10), ids)
    assert "".join(chunks) + tail == smollm2.decode(ids)
    assert len(ids) > 2000 and max(counting.sizes) <= 10
    assert len(counting.sizes) <= 2 * len(ids) + 2


def test_window_stays_bounded_when_the_model_emits_only_invalid_bytes():
    tok = byte_level_tokenizer()
    counting = CountingDecoder(tok)
    continuation = encode(tok, "中")[1]
    ids = [continuation] * 200
    chunks, tail, _ = stream(counting, [], ids)
    assert "".join(chunks) + tail == tok.decode(ids) == REPLACEMENT * 200
    assert max(counting.sizes) <= 2 * MAX_PENDING


def test_router_modules_never_import_torch():
    code = ("import sys, tgi_router.text.detokenizer, tgi_router.text.stop_strings; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
