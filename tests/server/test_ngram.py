"""The n-gram proposer: the longest recent suffix found earlier proposes
what followed it, incrementally, never matching the suffix itself."""

import random

from tgi_server.speculation.ngram import MAX_N, MIN_N, NgramIndex


def rescan(tokens: list[int], k: int) -> list[int]:
    """The definition, by brute force: for n from MAX_N down to MIN_N, the
    latest earlier occurrence of the last n tokens."""
    last = len(tokens) - 1
    for n in range(min(MAX_N, last), MIN_N - 1, -1):
        suffix = tokens[last - n + 1:]
        for end in range(last - 1, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


def test_copies_what_followed_the_suffix():
    index = NgramIndex()
    tokens = [1, 2, 3, 4, 5, 6, 9, 2, 3]
    assert index.propose(tokens, 3) == [4, 5, 6]
    assert index.propose(tokens, 10) == [4, 5, 6, 9, 2, 3]  # up to the end of what is known


def test_prefers_the_longest_suffix_then_the_latest_occurrence():
    tokens = [7, 3, 4, 1, 8, 3, 4, 2, 5, 3, 4]
    # "3 4" occurs twice before; "8 3 4"/"5 3 4" do not: the latest "3 4" wins
    assert NgramIndex().propose(tokens, 1) == [2]
    tokens = [9, 3, 4, 1, 8, 3, 4, 2, 9, 3, 4]
    assert NgramIndex().propose(tokens, 1) == [1]  # "9 3 4" beats the later "3 4"


def test_nothing_without_an_earlier_occurrence():
    index = NgramIndex()
    assert index.propose([1, 2, 3, 4], 4) == []
    assert index.propose([5], 4) == [] and index.propose([], 4) == []
    assert NgramIndex().propose([1, 2, 1, 2], 0) == []


def test_incremental_index_matches_a_rescan_and_survives_dropped_drafts():
    rng = random.Random(0)
    for _ in range(30):
        index = NgramIndex()
        tokens = [rng.randrange(6) for _ in range(5)]
        for _ in range(120):
            k = rng.randrange(1, 6)
            proposal = index.propose(tokens, k)
            assert proposal == rescan(tokens, k)
            # as the shard does: drafts appended, then replaced by what was sampled
            tokens.extend(proposal)
            del tokens[len(tokens) - len(proposal):]
            tokens.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))


class _Words:
    """A tokenizer of words, for the speculation benchmark's n-gram ceiling."""

    def __init__(self):
        self.ids: dict[str, int] = {}

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "user: " + messages[0]["content"] + " assistant:"

    def __call__(self, text, add_special_tokens):
        class Encoded:
            input_ids = [self.ids.setdefault(w, len(self.ids)) for w in text.split()]
        return Encoded()


def test_the_benchmarks_ceiling_counts_the_tokens_each_checked_step_keeps():
    from benchmarks.speculate import SPECULATE, ngram_ceiling

    assert SPECULATE == 7
    copied = "a b c d e f g h i j"
    # The prefill gives "a"; (j, a) occurred nowhere: one token ("b"); then (a, b) drafts c..i, all
    # right, plus the token after them ("j"): 1 + 8 tokens in 2 steps.
    assert ngram_ceiling(_Words(), (f"copy: {copied}",), [copied]) == 4.5
    assert ngram_ceiling(_Words(), (f"copy: {copied}",), ["k l m n"]) == 1.0  # new words: one a step
