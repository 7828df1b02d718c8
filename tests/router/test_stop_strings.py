"""Stop strings: TGI's behaviour by default (match where a token's text ends,
stop string kept in the output), OpenAI's with `trim=True` (match anywhere,
text before the stop string, minimal hold-back)."""

import random
import re

import pytest

from tgi_router.text.detokenizer import IncrementalDetokenizer
from tgi_router.text.stop_strings import StopStringMatcher


def run(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], str | None, str]:
    """Feeds pieces until a match; returns (emits, matched, flushed)."""
    emits, matched = [], None
    for piece in pieces:
        emit, matched = matcher.feed(piece)
        emits.append(emit)
        if matched is not None:
            break
    return emits, matched, matcher.flush()


class TGIOracle:
    """TGI's own StoppingCriteria text path (utils/tokens.py), restated."""

    def __init__(self, stop):
        self.regexes = [re.compile(f"{re.escape(s)}$") for s in stop]
        self.output = ""

    def __call__(self, last_output: str) -> bool:
        self.output += last_output
        if len(self.output) > 300:
            self.output = self.output[-200:]
        return any(r.findall(self.output) for r in self.regexes)


# --- TGI behaviour (default) ---------------------------------------------

def test_tgi_stop_spanning_three_tokens_matches_and_is_kept():
    emits, matched, tail = run(StopStringMatcher(["world"]), ["Hello", " wor", "l", "d", "!"])
    assert matched == "world"
    assert emits == ["Hello", " wor", "l", "d"] and tail == ""


def test_tgi_emits_every_piece_at_once_without_hold_back():
    m = StopStringMatcher(["world"])
    assert m.feed("Hello wor") == ("Hello wor", None)


def test_tgi_stop_ending_inside_a_token_does_not_match():
    # TGI issue #1979: stop "lo" never fires on the token "dolor".
    emits, matched, _ = run(StopStringMatcher(["lo"]), ["ipsum", " dolor", " sit"])
    assert matched is None and "".join(emits) == "ipsum dolor sit"


def test_tgi_stop_followed_by_one_newline_in_the_same_token_matches():
    # Python's `$` also matches before a final "\n".
    assert run(StopStringMatcher(["foo"]), ["a", "foo\n"])[1] == "foo"
    assert run(StopStringMatcher(["foo"]), ["a", "foo\n\n"])[1] is None


def test_tgi_stop_that_is_a_prefix_of_another():
    assert run(StopStringMatcher(["foo", "foobar"]), ["x", "foo", "bar"])[1] == "foo"
    assert run(StopStringMatcher(["foo", "foobar"]), ["x", "foobar"])[1] == "foobar"
    assert run(StopStringMatcher(["foobar", "foo"]), ["x", "fo", "o"])[1] == "foo"


def test_tgi_first_stop_in_the_given_order_wins():
    assert run(StopStringMatcher(["bar", "obar"]), ["foobar"])[1] == "bar"
    assert run(StopStringMatcher(["obar", "bar"]), ["foobar"])[1] == "obar"


def test_tgi_after_a_match_feed_returns_nothing():
    m = StopStringMatcher(["b"])
    assert m.feed("ab") == ("ab", "b")
    assert m.feed("c") == ("", None) and m.flush() == ""


@pytest.mark.parametrize("seed", range(20))
def test_tgi_agrees_with_tgis_regex_criteria_on_random_streams(seed):
    rng = random.Random(seed)
    stop = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 4))) for _ in range(3)]
    matcher, oracle = StopStringMatcher(stop), TGIOracle(stop)
    for _ in range(400):
        piece = "".join(rng.choice("abc\n") for _ in range(rng.randint(0, 3)))
        _, matched = matcher.feed(piece)
        assert (matched is not None) == oracle(piece)
        if matched is not None:
            break


def test_tgi_stop_across_real_smollm2_tokens():
    from tgi_server.weights.gguf import load_gguf_tokenizer
    from tgi_server.weights.resolve import default_model_path
    tok = load_gguf_tokenizer(default_model_path())
    ids = tok.encode("The answer is 42.\nUser: thanks", add_special_tokens=False)
    detok, matcher = IncrementalDetokenizer(tok), StopStringMatcher(["\nUser:"])
    streamed, stopped_after = "", None
    for n, i in enumerate(ids, 1):
        emit, matched = matcher.feed(detok.add(i))
        streamed += emit
        if matched:
            stopped_after = n
            break
    assert streamed == "The answer is 42.\nUser:"
    assert tok.decode(ids[:stopped_after]) == streamed  # TGI's generated_text
    assert len(tok.encode("\nUser:", add_special_tokens=False)) >= 2


# --- OpenAI behaviour (trim=True) ----------------------------------------

def test_trim_stop_spanning_three_tokens_returns_text_before_it():
    emits, matched, tail = run(StopStringMatcher(["o wor"], trim=True), ["Hel", "lo wo", "rld!"])
    assert matched == "o wor"
    assert emits == ["Hel", "l", ""] and tail == ""


def test_trim_stop_inside_one_token_matches():
    emits, matched, _ = run(StopStringMatcher(["lo"], trim=True), ["ipsum", " dolor"])
    assert matched == "lo" and "".join(emits) == "ipsum do"


def test_trim_stop_that_is_a_prefix_of_another_stops_at_the_first_completed():
    assert run(StopStringMatcher(["foobar", "foo"], trim=True), ["xfoobar"])[:2] == (["x"], "foo")
    assert run(StopStringMatcher(["foo", "foobar"], trim=True), ["x", "fo", "ob"])[:2] == (["x", "", ""], "foo")


def test_trim_two_stops_ending_together_cut_at_the_longer():
    assert run(StopStringMatcher(["bar", "foobar"], trim=True), ["xfoobar"])[:2] == (["x"], "foobar")


def test_trim_holds_back_only_a_possible_beginning_of_a_stop():
    m = StopStringMatcher(["world"], trim=True)
    assert m.feed("hello") == ("hello", None)  # "lo", "o" cannot begin "world"
    assert m.feed(" w") == (" ", None)
    assert m.feed("x") == ("wx", None)
    assert m.feed("wor") == ("", None)
    assert m.flush() == "wor"


def test_trim_holds_the_longest_possible_beginning():
    m = StopStringMatcher(["aab"], trim=True)
    assert m.feed("aa") == ("", None)
    assert m.feed("a") == ("a", None)
    assert m.feed("b") == ("", "aab")


@pytest.mark.parametrize("seed", range(20))
def test_trim_random_chunking_gives_the_text_before_the_first_stop(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("abcd ") for _ in range(200))
    stop = ["".join(rng.choice("abcd") for _ in range(rng.randint(2, 5))) for _ in range(3)]
    hits = [(text.find(s) + len(s), text.find(s)) for s in stop if s in text]
    expected = text[:min(hits)[1]] if hits else text
    cuts = sorted(rng.sample(range(1, len(text)), 60))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    emits, matched, tail = run(StopStringMatcher(stop, trim=True), pieces)
    assert "".join(emits) + tail == expected
    assert (matched is not None) == bool(hits)


def test_no_stop_strings_pass_text_through():
    for trim in (False, True):
        m = StopStringMatcher([], trim=trim)
        assert m.feed("abc") == ("abc", None) and m.flush() == ""
