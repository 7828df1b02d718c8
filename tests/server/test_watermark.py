"""The green-list watermark in the batched sampler, and its detector."""

import math

import torch

from tgi_server.sampling.sampler import Sampler
from tgi_server.sampling.sampling_params import SamplingParams
from tgi_server.sampling.watermark import HASH_KEY, Watermark

VOCAB = 1000


def test_the_green_list_is_tgi_s_permutation_seeded_by_the_previous_token():
    generator = torch.Generator().manual_seed(HASH_KEY * 42)
    expected = torch.randperm(VOCAB, generator=generator)[:int(VOCAB * 0.25)]
    assert torch.equal(Watermark(gamma=0.25).green_list(42, VOCAB), expected)
    assert not torch.equal(Watermark().green_list(42, VOCAB), Watermark().green_list(43, VOCAB))


def test_only_watermarked_rows_get_delta_on_their_green_list():
    logits = torch.zeros(2, VOCAB)
    watermark = Watermark(delta=3.0)
    watermark.apply(logits, [1], [7], VOCAB)
    green = torch.zeros(VOCAB, dtype=torch.bool)
    green[watermark.green_list(7, VOCAB)] = True
    assert torch.equal(logits[0], torch.zeros(VOCAB))
    assert torch.equal(logits[1], torch.where(green, 3.0, 0.0))


def test_the_sampler_biases_before_choosing_and_leaves_other_rows_alone():
    """On flat logits a watermarked greedy row picks a green token (the bias
    is all that separates them); its neighbour in the batch still takes token 0."""
    watermark = Watermark()
    sampler = Sampler(watermark)
    params = [SamplingParams(watermark=True), SamplingParams()]
    for previous in range(20):
        out = sampler(torch.zeros(2, VOCAB), params, [[5, previous], [5, previous]], [1, 1])
        assert out.token_ids[0] in set(watermark.green_list(previous, VOCAB).tolist())
        assert out.token_ids[1] == 0


def test_z_scores_count_each_distinct_pair_once():
    watermark = Watermark()
    tokens = [3]
    for _ in range(30):  # an all-green chain of new tokens: each green after the one before
        tokens.append(next(t for t in watermark.green_list(tokens[-1], VOCAB).tolist() if t not in tokens))
    z, green, scored = watermark.z_score(tokens, VOCAB)
    assert (green, scored) == (30, 30) and z == math.sqrt(30)
    looped = [1, 2] * 50  # one pair repeated: scored twice ((1, 2) and (2, 1)), not 99 times
    assert watermark.z_score(looped, VOCAB)[2] == 2
    assert watermark.z_score([9], VOCAB) == (0.0, 0, 0)
