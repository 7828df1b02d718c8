"""Speculation on a real shard (tiny random models, float32): n-gram drafts
checked in the step's forward give exactly the tokens of decoding without
them, greedy and seeded sampling alike, with penalties, the watermark,
top-n alternatives, stops inside accepted runs and grammars; sampled
tokens follow the model's distribution (chi-square)."""

import asyncio
import json
from pathlib import Path

import pytest
import torch

from tgi_proto import pb
from tgi_server.sampling.sampler import Sampler, SamplingParams
from tgi_server.sequences import ShardSequence
from tgi_server.speculation.verify import TokensUpTo, accepted, row_contexts

from ..shard_harness import DraftAlways, InProcessShard, greedy, run_prompts, save_tiny_model

# Prompts that repeat themselves (drafts found and often accepted), and ones that never do.
PROMPTS = [[1, 5, 9, 13, 200, 3] * 4, list(range(3, 40)), [7] * 20, [250, 4, 4, 17],
           [30, 31, 32, 33] * 6, [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100], [12, 60, 12, 60, 12], [5]]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec")
    path = save_tiny_model("llama", tmp / "llama", seed=2)
    with InProcessShard(tmp, str(path)) as s:
        yield s


def generate(shard, params=None, speculate=0, stop_ids=(), prompts=PROMPTS):
    stats = {}
    policy = DraftAlways(speculate) if speculate else None
    seqs = asyncio.run(run_prompts(shard.socket, prompts, NEW_TOKENS, params=params, stop_ids=stop_ids,
                                   speculation=policy, stats=stats))
    return seqs, policy


@pytest.mark.parametrize("speculate", [1, 3, 6])
def test_greedy_tokens_equal_decoding_without_drafts(shard, speculate):
    plain, _ = generate(shard)
    drafted, policy = generate(shard, speculate=speculate)
    assert [s.generated_ids for s in drafted] == [s.generated_ids for s in plain]
    assert policy.total_accepted >= 5 and policy.total_drafted > policy.total_accepted


SAMPLED = [greedy(do_sample=True, seed=7 + i, temperature=0.3, top_k=50 if i % 2 else 0, top_p=0.9 if i % 3 else 1.0,
                  repetition_penalty=1.3 if i % 4 == 1 else 0.0, frequency_penalty=0.4 if i % 4 == 2 else 0.0,
                  watermark=i % 4 == 3, top_n_tokens=3 if i % 2 else 0)
           for i in range(len(PROMPTS))]


def test_seeded_sampling_with_penalties_and_watermark_draws_the_same_tokens(shard):
    plain, _ = generate(shard, SAMPLED)
    drafted, policy = generate(shard, SAMPLED, speculate=4)
    assert [s.generated_ids for s in drafted] == [s.generated_ids for s in plain]
    assert policy.total_accepted > 0


def test_greedy_with_penalties_and_stops_inside_accepted_runs(shard):
    params = [greedy(repetition_penalty=1.2 if i % 2 else 0.0, presence_penalty=0.5 if i % 3 == 0 else 0.0)
              for i in range(len(PROMPTS))]
    plain, _ = generate(shard, params)
    # stop ids: tokens the plain run generates mid-way, so some runs end inside an accepted run
    stops = {s.generated_ids[len(s.generated_ids) // 2] for s in plain[:4]}
    plain, _ = generate(shard, params, stop_ids=stops)
    drafted, _ = generate(shard, params, speculate=6, stop_ids=stops)
    assert [s.generated_ids for s in drafted] == [s.generated_ids for s in plain]
    assert [s.finish_reason for s in drafted] == [s.finish_reason for s in plain]
    assert any(len(s.generated_ids) < NEW_TOKENS for s in drafted)


def test_logprobs_and_top_tokens_match_decoding_without_drafts(shard):
    async def steps(tokens: list[int], n: int, speculate: int) -> list[pb.Generation]:
        from tgi_router.scheduling.client import ShardClient
        client = ShardClient([shard.socket], timeout=60)
        await client.warmup(256, 8)
        out = []
        request = pb.StepRequest(new_sequences=[pb.NewSequence(
            id=1, token_ids=tokens, num_scheduled_tokens=len(tokens), block_table=list(range(12)),
            parameters=pb.SamplingParameters(top_n_tokens=3, max_new_tokens=n))])
        while sum(1 + len(g.next_tokens) for g in out) < n:
            out.append((await client.step(request)).generations[0])
            request = pb.StepRequest(running=[pb.RunningSequence(id=1, num_scheduled_tokens=1,
                                                                 num_draft_tokens=speculate)])
        await client.release([1])
        await client.close()
        return out

    def flatten(gens):
        return [(t.token_id, t.logprob, [(a.token_id, a.logprob) for a in t.top_tokens])
                for g in gens for t in (g, *g.next_tokens)]

    prompt = [7] * 20  # this model's text after it repeats itself: drafts get accepted
    plain, drafted = flatten(asyncio.run(steps(prompt, 60, 0))), asyncio.run(steps(prompt, 60, 4))
    assert any(g.next_tokens for g in drafted)
    drafted = flatten(drafted)
    assert [t for t, _, _ in drafted] == [t for t, _, _ in plain]
    for (_, lp, top), (_, lp0, top0) in zip(drafted, plain):
        assert lp == pytest.approx(lp0, abs=1e-4)
        assert [t for t, _ in top] == [t for t, _ in top0]
        assert [lp for _, lp in top] == pytest.approx([lp for _, lp in top0], abs=1e-4)


ARRAY_SCHEMA = ('{"type": "array", "minItems": 3, "maxItems": 3, "items": {"type": "object", '
                '"properties": {"identifier": {"type": "integer"}, "description": {"type": "string", '
                '"maxLength": 3}}, "required": ["identifier", "description"], "additionalProperties": false}}')


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_constrained_sequences_draft_what_the_grammar_allows_and_keep_the_same_tokens(tmp_path, do_sample):
    """A JSON array of objects repeats its keys: n-gram drafts of them are
    allowed by the grammar and forced by it, so they are accepted; the
    tokens are those of decoding without drafts, budget included."""
    import llguidance

    from ..shard_harness import save_tiny_served_model
    path = save_tiny_served_model(tmp_path / "served", seed=3)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(ARRAY_SCHEMA)
    prompts = [list(b"list: "), list(b"abcabcabcabc"), list(b"[{")]
    params = [greedy(grammar=grammar, max_new_tokens=120, do_sample=do_sample, seed=3), greedy(),
              greedy(grammar=grammar, max_new_tokens=90, do_sample=do_sample, seed=4)]
    with InProcessShard(tmp_path, str(path)) as served:
        plain = asyncio.run(run_prompts(served.socket, prompts, 120, params=params, stop_ids=(257,)))
        policy = DraftAlways(4)
        drafted = asyncio.run(run_prompts(served.socket, prompts, 120, params=params, stop_ids=(257,),
                                          speculation=policy))
    assert [s.generated_ids for s in drafted] == [s.generated_ids for s in plain]
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    for s in (drafted[0], drafted[2]):
        text = tokenizer.decode(s.generated_ids)
        assert [set(item) for item in json.loads(text)] == [{"identifier", "description"}] * 3
    assert policy.total_accepted > 10


def test_a_grammar_allows_a_drafts_prefix(tmp_path):
    import llguidance

    from tgi_server.sampling.grammar import GrammarCompiler

    from ..shard_harness import save_tiny_served_model
    path = save_tiny_served_model(tmp_path / "served")
    compiler = GrammarCompiler((path / "tokenizer.json").read_text(), 320, [257])
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    state = compiler.start(1, llguidance.LLMatcher.grammar_from_regex(r"ab+c"), [])
    assert compiler.allowed_prefix(state, tokenizer.encode("abbbc", add_special_tokens=False).ids) == 5
    assert compiler.allowed_prefix(state, tokenizer.encode("abxc", add_special_tokens=False).ids) == 2
    assert compiler.allowed_prefix(state, tokenizer.encode("c", add_special_tokens=False).ids) == 0


def test_row_contexts_and_acceptance():
    seq = ShardSequence(id=1, token_ids=[1, 2, 3, 8, 9], prompt_length=2, num_computed=2, block_table=[0],
                        params=SamplingParams(), prefill_logprobs=False, scheduled=3, drafted=2)
    owners, depths, contexts = row_contexts([seq])
    assert owners == [0, 0, 0] and depths == [0, 1, 2]
    assert [list(c) for c in contexts] == [[1, 2, 3], [1, 2, 3, 8], [1, 2, 3, 8, 9]]
    assert contexts[1][-1] == 8 and contexts[1][2:] == [3, 8] and len(contexts[0]) == 3
    assert accepted(seq, [8, 9, 4]) == 3 and accepted(seq, [8, 5, 4]) == 2 and accepted(seq, [7, 9, 4]) == 1
    view = TokensUpTo([4, 5, 6], 2)
    with pytest.raises(IndexError):
        view[2]


# Upper 0.1% point of the chi-square distribution with 7 degrees of freedom.
CHI2_7_999 = 24.32


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))


def test_sampled_tokens_follow_the_models_distribution():
    """On an 8-token vocabulary: many seeds draw position 0 with a draft of
    token 2 checked there, and the kept token's frequencies fit the target
    distribution p (chi-square, 7 degrees of freedom) and those of the
    sampler without drafts; the draft is accepted about p(2) of the time."""
    torch.manual_seed(0)
    logits = torch.randn(8) * 0.8  # the target's next-token logits, independent of history here
    p = torch.softmax(logits, 0).tolist()
    sampler = Sampler()
    draws, plain, accepts = 4000, [0] * 8, 0
    kept_counts = [0] * 8
    for seed in range(draws):
        params = SamplingParams(do_sample=True, seed=seed)
        seq = ShardSequence(id=1, token_ids=[0, 1, 2], prompt_length=1, num_computed=1, block_table=[0],
                            params=params, prefill_logprobs=False, scheduled=2, drafted=1)  # token 2 drafted
        _, _, contexts = row_contexts([seq])
        out = sampler(logits.expand(2, 8).contiguous(), [params, params], contexts, [1, 1])
        kept = accepted(seq, out.token_ids)
        accepts += kept == 2
        kept_counts[out.token_ids[0]] += 1
        alone = sampler(logits.unsqueeze(0), [params], [[0, 1]], [1])
        plain[alone.token_ids[0]] += 1
    assert chi_square(kept_counts, p) < CHI2_7_999
    assert chi_square(plain, p) < CHI2_7_999
    assert kept_counts == plain  # the same seed draws the same token, drafts or not
    assert accepts / draws == pytest.approx(p[2], abs=4 * (p[2] * (1 - p[2]) / draws) ** 0.5)


@pytest.fixture(scope="module")
def served_pair(tmp_path_factory):
    """(target, a smaller draft) sharing the byte-level tokenizer."""
    from ..shard_harness import save_tiny_served_model
    tmp = tmp_path_factory.mktemp("draft")
    target = save_tiny_served_model(tmp / "target", seed=6)
    draft = save_tiny_served_model(tmp / "draft", seed=7, num_hidden_layers=1, hidden_size=32,
                                   intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    return tmp, target, draft


DRAFT_PROMPTS = [list(b"abcabcabcabcabc"), list(b"the cat sat on the mat. the cat"), list(b"hello"),
                 list(b"0123456789" * 3), [256] + list(b"xyxyxy")]


@pytest.mark.parametrize("which", ["smaller", "itself"])
def test_a_draft_model_gives_the_targets_greedy_tokens(served_pair, which):
    """With a smaller draft the drafts are mostly wrong and the output is the
    target's; with the target as its own draft nearly every draft is right,
    which only holds if the draft's K/V stays in step with the tokens kept."""
    tmp, target, draft = served_pair
    params = [greedy(max_new_tokens=30)] * len(DRAFT_PROMPTS)
    for name in ("plain", which):
        (tmp / name).mkdir(exist_ok=True)
    with InProcessShard(tmp / "plain", str(target)) as shard:
        plain = asyncio.run(run_prompts(shard.socket, DRAFT_PROMPTS, 30, params=params))
    model = draft if which == "smaller" else target
    policy = DraftAlways(4)
    with InProcessShard(tmp / which, str(target), speculative_model=str(model)) as shard:
        drafted = asyncio.run(run_prompts(shard.socket, DRAFT_PROMPTS, 30, params=params, speculation=policy))
        assert shard.runner.draft.cache.num_blocks == shard.runner.cache.num_blocks
    assert [s.generated_ids for s in drafted] == [s.generated_ids for s in plain]
    assert policy.total_drafted > 0
    if which == "itself":
        assert policy.acceptance_rate > 0.9


def test_a_draft_model_with_another_vocabulary_is_refused(served_pair, tmp_path):
    _, target, _ = served_pair
    other = save_tiny_model("llama", tmp_path / "other", seed=1)  # no tokenizer of its own
    with pytest.raises(ValueError, match="tokenizer"):
        InProcessShard(tmp_path, str(target), speculative_model=str(other))


def save_medusa(path, heads: int, layers: int = 1, copy_lm_head: bool = False, seed: int = 0):
    """Medusa heads beside a tiny served model's weights (TGI's file and config
    fields). copy_lm_head: head 0 is the identity then the model's own LM
    head, so it drafts the token the model just predicted (right in a loop)."""
    import json

    from safetensors.torch import load_file, save_file
    config = json.loads((path / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    torch.manual_seed(seed)
    tensors = {}
    for i in range(heads):
        for j in range(layers):
            tensors[f"{i}.{j}.linear.weight"] = torch.randn(hidden, hidden) * 0.05
            tensors[f"{i}.{j}.linear.bias"] = torch.zeros(hidden)
        tensors[f"{i}.{layers}.weight"] = torch.randn(vocab, hidden) * 0.1
    if copy_lm_head:
        weights = load_file(str(path / "model.safetensors"))
        lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        for j in range(layers):
            tensors[f"0.{j}.linear.weight"] = torch.zeros(hidden, hidden)  # x + silu(0) = x
        tensors[f"0.{layers}.weight"] = lm_head.clone()
    save_file(tensors, str(path / "medusa_lm_head.safetensors"))
    config.update(medusa_num_heads=heads, medusa_num_layers=layers)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("copy_lm_head", [False, True], ids=["random heads", "head 0 = the LM head"])
def test_medusa_heads_draft_and_the_tokens_stay_the_targets(served_pair, tmp_path, copy_lm_head):
    import shutil
    _, target, _ = served_pair
    medusa = save_medusa(Path(shutil.copytree(target, tmp_path / "medusa")), heads=3, copy_lm_head=copy_lm_head)
    prompts = DRAFT_PROMPTS + [[256] + [7] * 12]
    params = [greedy(max_new_tokens=30)] * len(prompts)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with InProcessShard(tmp_path / "a", str(target)) as shard:
        plain = asyncio.run(run_prompts(shard.socket, prompts, 30, params=params))
    policy = DraftAlways(3)
    with InProcessShard(tmp_path / "b", str(medusa)) as shard:
        assert shard.info.medusa_heads == 3
        drafted = asyncio.run(run_prompts(shard.socket, prompts, 30, params=params, speculation=policy))
    assert [s.generated_ids for s in drafted] == [s.generated_ids for s in plain]
    assert policy.total_drafted > 0
    print("medusa", copy_lm_head, policy.total_drafted, policy.total_accepted)
