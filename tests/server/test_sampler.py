"""The shard's batched sampler: HF semantics of every warper and penalty, greedy,
seeded batch-invariant draws, top-n tokens, prompt logprobs and the processor hook."""

import math
import random
from dataclasses import replace

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from tgi_server.sampling.logits_warpers import TOP_P_BLOCKS
from tgi_server.sampling.sampler import Sampler, SamplingParams, draw_uniform, prompt_logprobs
from tgi_server.sampling.vocab_blocks import BLOCK

V = 512


def rand_logits(b: int, v: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * scale


def sample(logits, params, token_ids=None, prompt_lens=None, processors=()):
    token_ids = token_ids if token_ids is not None else [[1, 2, 3]] * len(params)
    prompt_lens = prompt_lens if prompt_lens is not None else [len(t) for t in token_ids]
    return Sampler()(logits, params, token_ids, prompt_lens, processors)


def hf_chain(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The reference: HF warpers in our order on one row [V] -> [V]."""
    x = row.unsqueeze(0).clone()
    warpers = [TemperatureLogitsWarper(p.temperature)] if p.temperature != 1.0 else []
    warpers += [TopKLogitsWarper(p.top_k)] if p.top_k else []
    warpers += [TopPLogitsWarper(p.top_p)] if p.top_p < 1.0 else []
    warpers += [TypicalLogitsWarper(p.typical_p)] if p.typical_p < 1.0 else []
    warpers += [MinPLogitsWarper(p.min_p)] if p.min_p > 0.0 else []
    for w in warpers:
        x = w(None, x)
    return x.squeeze(0)


def check_warp_rows(params, logits):
    """Every row's listed top-n (all V tokens asked) is HF's surviving set with its logprobs."""
    v = logits.shape[1]
    out = sample(logits, [replace(p, top_n_tokens=v) for p in params])
    for i, p in enumerate(params):
        ref = torch.log_softmax(hf_chain(logits[i], p), 0)
        listed = dict(out.top_tokens[i])
        assert sorted(listed) == torch.isfinite(ref).nonzero().squeeze(1).tolist()
        torch.testing.assert_close(torch.tensor([listed[t] for t in sorted(listed)]),
                                   ref[torch.isfinite(ref)], atol=1e-5, rtol=1e-5)
        assert out.token_ids[i] in listed


def test_greedy_takes_argmax_with_its_logprob():
    logits = rand_logits(8)
    out = sample(logits, [SamplingParams()] * 8)
    assert out.token_ids == logits.argmax(dim=1).tolist()
    expected = torch.log_softmax(logits, dim=1).max(dim=1).values
    torch.testing.assert_close(torch.tensor(out.logprobs), expected)
    assert out.top_tokens == [[]] * 8


def test_greedy_breaks_ties_toward_the_lowest_id():
    logits = torch.randint(0, 3, (6, 700), generator=torch.Generator().manual_seed(2)).float()
    assert sample(logits, [SamplingParams()] * 6).token_ids == logits.argmax(dim=1).tolist()


def test_greedy_rows_ignore_temperature_and_warpers():
    logits = rand_logits(2)
    params = [SamplingParams(temperature=0.3, top_k=2, top_n_tokens=3), SamplingParams(do_sample=True, seed=1)]
    out = sample(logits, params)
    raw = torch.log_softmax(logits[0], 0)
    assert out.token_ids[0] == int(raw.argmax())
    assert [lp for _, lp in out.top_tokens[0]] == pytest.approx(raw.topk(3).values.tolist(), abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_greedy_row_chooses_the_same_bits_in_an_all_greedy_batch_and_beside_others(dtype):
    """A batch of greedy rows and nothing to change goes straight from the
    logits (no float32 copy); beside a sampling row, a penalized row or a
    top-n request it goes BlockedRows' way: the greedy rows' tokens and
    logprobs are the same bits either way."""
    logits = rand_logits(4, v=49152, seed=5, scale=4.0).to(dtype)
    greedy = sample(logits, [SamplingParams()] * 4)
    for other in (SamplingParams(do_sample=True, seed=3), SamplingParams(repetition_penalty=1.3),
                  SamplingParams(top_n_tokens=2)):
        mixed = sample(logits, [SamplingParams()] * 3 + [other])
        assert mixed.token_ids[:3] == greedy.token_ids[:3] and mixed.logprobs[:3] == greedy.logprobs[:3]
    assert greedy.token_ids == logits.float().argmax(dim=1).tolist()
    torch.testing.assert_close(torch.tensor(greedy.logprobs),
                               torch.log_softmax(logits.double(), dim=1).max(dim=1).values.float())


def test_input_logits_are_left_untouched():
    logits = rand_logits(3)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.5),
              SamplingParams(do_sample=True, temperature=0.5, top_k=5, top_p=0.8),
              SamplingParams(do_sample=True, min_p=0.1)]
    sample(logits, params, processors=[lambda x: x[:, 0].fill_(-math.inf)])
    assert torch.equal(logits, before)


def test_bfloat16_logits_are_sampled_in_float32():
    logits = rand_logits(4).bfloat16()
    out = sample(logits, [SamplingParams(top_n_tokens=2)] * 4)
    assert out.token_ids == logits.float().argmax(dim=1).tolist()


def test_temperature_matches_hf():
    check_warp_rows([SamplingParams(do_sample=True, temperature=t) for t in (0.3, 1.0, 1.7)],
                    rand_logits(3))


def test_top_k_matches_hf_per_row():
    check_warp_rows([SamplingParams(do_sample=True, top_k=k) for k in (1, 7, 0, 50, V + 10)],
                    rand_logits(5))


def test_top_p_matches_hf_per_row():
    check_warp_rows([SamplingParams(do_sample=True, top_p=p) for p in (0.05, 0.5, 1.0, 0.9, 0.999)],
                    rand_logits(5))


def test_top_p_beyond_the_first_blocks_matches_hf():
    # A flat distribution: top_p needs far more than the first blocks it looks at.
    logits = rand_logits(3, v=4 * TOP_P_BLOCKS[-1] * BLOCK, scale=0.1)
    check_warp_rows([SamplingParams(do_sample=True, top_p=p) for p in (0.95, 0.3, 0.01)], logits)


def test_top_k_keeps_ties_with_the_kth_logit_like_hf():
    # Few distinct values (as with bfloat16 logits): hundreds of tokens tie with the k-th.
    logits = torch.randint(0, 6, (3, 2000), generator=torch.Generator().manual_seed(1)).float()
    check_warp_rows([SamplingParams(do_sample=True, top_k=k) for k in (3, 40, 500)], logits)


def test_vocabulary_not_a_multiple_of_the_block_size():
    logits = rand_logits(4, v=1000)
    check_warp_rows([SamplingParams(do_sample=True, temperature=0.7), SamplingParams(),
                     SamplingParams(do_sample=True, top_k=20, top_p=0.8),
                     SamplingParams(do_sample=True, min_p=0.05)], logits)
    out = sample(logits, [SamplingParams()] * 4)
    assert out.token_ids == logits.argmax(dim=1).tolist()


def test_top_p_keeps_or_drops_tied_tokens_together():
    # HF keeps whichever of three tied tokens its sort puts first; we keep all three.
    logits = torch.tensor([[2.0, 0.0, 2.0, 2.0, -1.0]])
    out = sample(logits, [SamplingParams(do_sample=True, top_p=0.5, top_n_tokens=5)])
    assert sorted(t for t, _ in out.top_tokens[0]) == [0, 2, 3]


def test_top_k_then_top_p_matches_hf():
    check_warp_rows([SamplingParams(do_sample=True, temperature=0.8, top_k=k, top_p=p)
                     for k, p in ((10, 0.7), (40, 0.95), (3, 0.2))], rand_logits(3))


def test_typical_p_matches_hf():
    check_warp_rows([SamplingParams(do_sample=True, typical_p=m) for m in (0.2, 0.9, 1.0)],
                    rand_logits(3))


def test_typical_p_after_top_k_matches_hf():
    check_warp_rows([SamplingParams(do_sample=True, top_k=k, typical_p=0.7) for k in (20, 64)],
                    rand_logits(2))


def test_min_p_matches_hf():
    check_warp_rows([SamplingParams(do_sample=True, temperature=0.7, min_p=m) for m in (0.01, 0.3, 0.0)],
                    rand_logits(3))


def test_all_warpers_in_order_match_hf():
    p = SamplingParams(do_sample=True, temperature=1.3, top_k=80, top_p=0.9, typical_p=0.8, min_p=0.02)
    check_warp_rows([p, SamplingParams(do_sample=True)], rand_logits(2))


def test_repetition_penalty_counts_prompt_and_generated_like_hf():
    logits = rand_logits(2)
    tokens = [[5, 9, 9, 30], [7, 400, 11]]
    params = [SamplingParams(repetition_penalty=1.8, top_n_tokens=V)] * 2
    out = sample(logits, params, tokens, prompt_lens=[3, 1])
    for i in range(2):
        ref = RepetitionPenaltyLogitsProcessor(1.8)(torch.tensor([tokens[i]]), logits[i:i + 1].clone())[0]
        got = dict(out.top_tokens[i])
        torch.testing.assert_close(torch.tensor([got[t] for t in range(V)]), torch.log_softmax(ref, 0))


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    logits = torch.zeros(1, 8)
    tokens = [[1, 1, 2, 3, 3, 3, 4]]  # prompt 1 1 2; generated 3 3 3 4
    out = sample(logits, [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, top_n_tokens=8)],
                 tokens, prompt_lens=[3])
    expected = torch.zeros(8)
    expected[3] -= 0.5 * 3 + 0.25
    expected[4] -= 0.5 * 1 + 0.25
    got = dict(out.top_tokens[0])
    torch.testing.assert_close(torch.tensor([got[t] for t in range(8)]), torch.log_softmax(expected, 0))


def test_penalties_touch_only_their_rows():
    logits = rand_logits(3)
    params = [SamplingParams(top_n_tokens=V), SamplingParams(presence_penalty=2.0),
              SamplingParams(top_n_tokens=V)]
    out = sample(logits, params, [[1, 2, 3], [1, 2, 3], [1, 2, 3]], prompt_lens=[1, 1, 1])
    for i in (0, 2):
        got = dict(out.top_tokens[i])
        torch.testing.assert_close(torch.tensor([got[t] for t in range(V)]), torch.log_softmax(logits[i], 0))


@pytest.mark.parametrize("target", [
    SamplingParams(do_sample=True, seed=42, temperature=0.9),
    SamplingParams(do_sample=True, seed=42, temperature=0.9, top_k=20, top_p=0.9),
    SamplingParams(do_sample=True, seed=42, top_p=0.8),
    SamplingParams(do_sample=True, seed=42, typical_p=0.7),
    SamplingParams(do_sample=True, seed=42, min_p=0.05, frequency_penalty=0.5),
], ids=["plain", "top_k_top_p", "top_p", "typical_p", "min_p"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seeded_draw_ignores_batch_companions_order_and_size(target, dtype):
    logits = rand_logits(6, scale=1.0).to(dtype)  # bfloat16: many ties
    others = [SamplingParams(), SamplingParams(do_sample=True, seed=7, top_k=300),
              SamplingParams(do_sample=True, seed=42, top_p=0.5), SamplingParams(do_sample=True, min_p=0.2),
              SamplingParams(do_sample=True, seed=3, repetition_penalty=1.3, typical_p=0.5)]
    tokens = [list(range(10 + i)) for i in range(6)]
    alone = sample(logits[:1], [target], tokens[:1])
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 0, 1], [2, 0], [4, 1, 5, 0, 3, 2]):
        params = [target if i == 0 else others[i - 1] for i in order]
        out = sample(logits[order], params, [tokens[i] for i in order])
        assert out.token_ids[order.index(0)] == alone.token_ids[0]
        assert out.logprobs[order.index(0)] == pytest.approx(alone.logprobs[0], abs=1e-5)


def test_same_seed_and_position_repeat_the_draw():
    logits = rand_logits(1, scale=0.5)
    params = [SamplingParams(do_sample=True, seed=11)]
    draws = {sample(logits, params, [[0] * 5]).token_ids[0] for _ in range(5)}
    assert len(draws) == 1


class SplitMix64:
    """The reference generator, as published (Steele, Lea and Flood, 2014;
    Vigna's splitmix64.c): the state advances by the golden gamma, and each
    output is the new state mixed."""
    GAMMA, MASK = 0x9E3779B97F4A7C15, 2**64 - 1

    def __init__(self, seed: int):
        self.state = seed & self.MASK

    def next(self) -> int:
        self.state = (self.state + self.GAMMA) & self.MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self.MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self.MASK
        return z ^ (z >> 31)


def test_the_reference_splitmix64_gives_the_published_outputs():
    seeded = SplitMix64(1234567)  # the test vector of Rosetta Code's "Pseudo-random numbers/Splitmix64"
    assert [seeded.next() for _ in range(5)] == [6457827717110365317, 3203168211198807973, 9817491932198370423,
                                                 4593380528125082431, 16408922859458223821]
    assert SplitMix64(0).next() == 0xE220A8397B1DCDAF


def test_draw_uniform_is_splitmix64_of_seed_then_position():
    """The rule draw_uniform documents, computed with the reference generator
    (integer arithmetic: any process, any device, any version of torch)."""
    def expected(seed: int, position: int) -> float:
        return (SplitMix64(SplitMix64(seed).next() ^ position).next() >> 11) / 2**53

    rng = random.Random(0)
    cases = [(0, 0), (2**64 - 1, 12345), (1, 2**40)] + [(rng.getrandbits(64), rng.randrange(2**20)) for _ in range(200)]
    for seed, position in cases:
        assert draw_uniform(seed, position) == expected(seed, position), (seed, position)
    assert draw_uniform(1, 0) != draw_uniform(0, 1)  # seed and position are not interchangeable


def test_draw_uniform_is_uniform_on_zero_to_one():
    draws = [draw_uniform(seed, position) for seed in range(40) for position in range(100)]
    assert all(0.0 <= u < 1.0 for u in draws)
    counts = [0] * 10
    for u in draws:
        counts[int(u * 10)] += 1
    chi2 = sum((c - 400) ** 2 / 400 for c in counts)
    assert chi2 < 37.0  # df = 9: p < 1e-4 for uniform draws


def test_different_seeds_and_positions_draw_differently():
    logits = rand_logits(1, scale=0.1).expand(32, V)
    by_seed = sample(logits, [SamplingParams(do_sample=True, seed=s) for s in range(32)], [[1]] * 32)
    by_pos = sample(logits, [SamplingParams(do_sample=True, seed=5)] * 32, [[1] * n for n in range(32)])
    assert len(set(by_seed.token_ids)) > 20 and len(set(by_pos.token_ids)) > 20


@pytest.mark.parametrize("params", [SamplingParams(do_sample=True, seed=3),
                                    SamplingParams(do_sample=True, seed=3, temperature=2.0, top_k=4)])
def test_seeded_draws_follow_the_final_distribution(params):
    n, v = 6000, 6
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5]])
    out = sample(logits.expand(n, v), [params] * n, [range(pos) for pos in range(n)])
    probs = torch.softmax(hf_chain(logits[0], params), 0)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=v).double()
    assert counts[probs == 0].sum() == 0
    expected = probs.double() * n
    live = probs > 0
    chi2 = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    assert chi2 < 25.0  # df <= 5: p < 1e-4 for a correct sampler


def test_top_n_tokens_are_sorted_and_agree_with_the_chosen_logprob():
    logits = rand_logits(3)
    params = [SamplingParams(top_n_tokens=5),
              SamplingParams(do_sample=True, seed=1, temperature=2.0, top_k=30, top_p=0.95, top_n_tokens=4),
              SamplingParams(do_sample=True, seed=2)]
    out = sample(logits, params)
    assert [len(t) for t in out.top_tokens] == [5, 4, 0]
    for i in (0, 1):
        lps = [lp for _, lp in out.top_tokens[i]]
        assert lps == sorted(lps, reverse=True)
        final = torch.log_softmax(hf_chain(logits[i], params[i]), 0)
        for token, lp in out.top_tokens[i]:
            assert lp == pytest.approx(float(final[token]), abs=1e-5)
        assert out.logprobs[i] == pytest.approx(float(final[out.token_ids[i]]), abs=1e-5)
        if out.token_ids[i] in dict(out.top_tokens[i]):
            assert dict(out.top_tokens[i])[out.token_ids[i]] == out.logprobs[i]
    assert out.top_tokens[0][0] == (out.token_ids[0], out.logprobs[0])


def test_prompt_logprobs_gather_the_raw_log_softmax():
    logits = rand_logits(7).bfloat16()
    targets = torch.tensor([3, 0, 511, 8, 8, 100, 42])
    expected = torch.log_softmax(logits.float(), 1).gather(1, targets.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(prompt_logprobs(logits, targets)), expected)
    assert prompt_logprobs(logits[:0], targets[:0]) == []


def test_processor_masking_all_but_one_token_forces_it():
    def only_token_17_on_rows_0_and_1(x: torch.Tensor) -> None:
        keep = x[:2, 17].clone()
        x[:2] = -math.inf
        x[:2, 17] = keep

    logits = rand_logits(3)
    params = [SamplingParams(), SamplingParams(do_sample=True, seed=9, temperature=3.0, top_n_tokens=2),
              SamplingParams()]
    out = sample(logits, params, processors=[only_token_17_on_rows_0_and_1])
    assert out.token_ids[:2] == [17, 17] and out.logprobs[:2] == [0.0, 0.0]
    assert out.top_tokens[1] == [(17, 0.0)]  # masked tokens are never listed
    assert out.token_ids[2] == int(logits[2].argmax())


def test_one_sampler_reused_across_shapes_gives_fresh_results():
    reused = Sampler()
    mixed = [SamplingParams(do_sample=True, seed=1, top_k=9, top_n_tokens=3), SamplingParams(),
             SamplingParams(repetition_penalty=1.2), SamplingParams(do_sample=True, seed=2)]
    cases = [(rand_logits(4, v=1000, seed=s), mixed) for s in range(2)]
    cases.append((rand_logits(2, seed=5), [SamplingParams(presence_penalty=1.0)] * 2))
    for logits, params in cases * 2:
        tokens, prompt_lens = [[1, 2, 3]] * len(params), [1] * len(params)
        assert reused(logits, params, tokens, prompt_lens) == sample(logits, params, tokens, prompt_lens)


def test_logits_needing_grad_are_sampled_too():
    logits = rand_logits(2).requires_grad_()
    out = sample(logits, [SamplingParams(do_sample=True, seed=1, top_k=5),
                          SamplingParams(presence_penalty=1.0)])
    assert out.token_ids[1] == int(logits[1].argmax())


def test_empty_batch():
    out = sample(torch.empty(0, V), [], [], [])
    assert out.token_ids == [] and out.logprobs == [] and out.top_tokens == []
