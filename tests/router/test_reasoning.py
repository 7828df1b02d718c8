"""The reasoning split, whole and streamed: every way of cutting the text
into pieces streams the same reasoning and content as the whole split."""

import itertools

import pytest

from tgi_router.text.reasoning import ReasoningParser

# (text, qwen3's (reasoning, content), deepseek_r1's)
CASES = [
    ("<think>Let me count.</think>\n\nThe answer is four.",
     ("Let me count.", "\n\nThe answer is four."), ("Let me count.", "\n\nThe answer is four.")),
    ("The answer.", (None, "The answer."), ("The answer.", "")),
    ("<think>cut off", ("cut off", ""), ("cut off", "")),
    ("<thi", (None, "<thi"), ("<thi", "")),
    ("</think>x", (None, "</think>x"), ("", "x")),
    ("<think></think>", ("", ""), ("", "")),
    ("<think>a</thin", ("a</thin", ""), ("a</thin", "")),
    ("a</think>b</think>c", (None, "a</think>b</think>c"), ("a", "b</think>c")),
    ("<think><think>a</think></think>", ("<think>a", "</think>"), ("<think>a", "</think>")),
]


@pytest.mark.parametrize("style", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text,qwen3,deepseek_r1", CASES)
def test_split_and_stream_agree(style, text, qwen3, deepseek_r1):
    parser = ReasoningParser(style)
    expected = qwen3 if style == "qwen3" else deepseek_r1
    assert parser.split(text) == expected
    # every cut of the text into up to three pieces
    for cuts in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        pieces = [text[:cuts[0]], text[cuts[0]:cuts[1]], text[cuts[1]:]]
        stream = parser.stream()
        out = {"reasoning": "", "content": ""}
        for kind, value in [p for piece in pieces for p in stream.feed(piece)] + stream.finish():
            assert value
            out[kind] += value
        assert (out["reasoning"], out["content"]) == (expected[0] or "", expected[1])
