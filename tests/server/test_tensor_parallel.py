"""Tensor parallelism (--num-shard N): N real `text-generation-server serve`
processes, started as the launcher starts them and talking over gloo on the
CPU, give the tokens one shard gives, while each holds ~1/N of the weights."""

import asyncio
import os
import re
import subprocess
import sys

import llguidance
import pytest
import torch

from tgi_proto import pb
from tgi_proto.rpc import StatusCode
from tgi_router.scheduling.client import ShardClient, ShardError
from tgi_server.distributed import TensorParallel
from tgi_server.layers.attention import HeadShard
from tgi_server.model_loader import load_model, open_checkpoint, weight_bytes
from tgi_server.weights.resolve import default_model_path, resolve_model

from ..shard_harness import (
    DraftAlways,
    InProcessShard,
    ShardProcesses,
    greedy,
    run_prompts,
    save_tiny_model,
    save_tiny_served_model,
    torch_threads,
)

PROMPTS = [[1, 5, 9, 13, 200, 3], list(range(3, 40)), [7] * 20, [250, 4, 4, 17]]
SAMPLED = [greedy(do_sample=True, seed=11 + i, temperature=0.9, top_k=40, top_p=0.95) for i in range(len(PROMPTS))]
# name -> (save_tiny_model arguments, world size)
MODELS = {
    # With a tokenizer (save_tiny_served_model: 320 ids, <s> 256, </s> 257): the
    # grammar and draft-model tests below run on this group's ranks too.
    "llama": (dict(model_type="llama", num_attention_heads=8, num_key_value_heads=4), 2),
    # Biases on q/k/v, and tied embeddings (qwen2's tiny checkpoint ties them, as
    # Qwen2-0.5B does): the vocabulary-parallel embedding is also the LM head.
    "qwen2": (dict(model_type="qwen2", num_attention_heads=8, num_key_value_heads=4), 2),
    # One kv head copied on all 3 ranks; 256 ids padded to 258 for the vocabulary split.
    "mqa": (dict(model_type="llama", hidden_size=48, intermediate_size=96, num_attention_heads=6,
                 num_key_value_heads=1), 3),
}


def call(sockets: list[str], fn):
    async def go():
        client = ShardClient(sockets, timeout=60)
        try:
            return await fn(client)
        finally:
            await client.close()
    return asyncio.run(go())


def generate(sockets, params=None, speculation=None) -> list[list[int]]:
    return [s.generated_ids for s in asyncio.run(run_prompts(sockets, PROMPTS, 12, params=params,
                                                             speculation=speculation))]


def logprob_step(sockets) -> pb.Generation:
    """One prefill with prompt logprobs and the top 5 tokens."""
    call(sockets, lambda c: c.warmup(64, 4))
    request = pb.StepRequest(new_sequences=[pb.NewSequence(
        id=1, token_ids=PROMPTS[1], num_scheduled_tokens=len(PROMPTS[1]), block_table=[0, 1, 2],
        parameters=pb.SamplingParameters(top_n_tokens=5, prefill_logprobs=True))])
    (gen,) = call(sockets, lambda c: c.step(request)).generations
    call(sockets, lambda c: c.clear_cache())
    return gen


class Reference:
    """What one shard in this process answers for a model (`constrained`:
    the grammar-constrained answers, for a model with a tokenizer)."""

    def __init__(self, tmp_path, path, grammars: bool = False):
        with torch_threads(1), InProcessShard(tmp_path, str(path)) as shard:
            self.greedy = generate(shard.socket)
            self.sampled = generate(shard.socket, SAMPLED)
            self.step = logprob_step([shard.socket])
            self.weight_bytes = weight_bytes(shard.runner.model)
            self.constrained = constrained(shard.socket) if grammars else None


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(running ShardProcesses, Reference, model path) of the "llama" group,
    kept for the whole module: `group` and `served` share its ranks."""
    kwargs, world_size = MODELS["llama"]
    tmp = tmp_path_factory.mktemp("llama")
    path = save_tiny_served_model(tmp / "model", seed=3, **{k: v for k, v in kwargs.items() if k != "model_type"})
    reference = Reference(tmp, path, grammars=True)
    with ShardProcesses(tmp, str(path), world_size) as shards:
        yield shards, reference, path


@pytest.fixture(scope="module", params=list(MODELS))
def group(request, tmp_path_factory):
    """(model name, running ShardProcesses, its one-shard Reference)."""
    if request.param == "llama":
        shards, reference, _ = request.getfixturevalue("llama")
        yield request.param, shards, reference
        return
    kwargs, world_size = MODELS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    path = save_tiny_model(**kwargs, path=tmp / "model", seed=3)
    reference = Reference(tmp, path)
    with ShardProcesses(tmp, str(path), world_size) as shards:
        yield request.param, shards, reference


def test_greedy_tokens_match_one_shard(group):
    _, shards, reference = group
    assert generate(shards.sockets) == reference.greedy


def test_seeded_sampling_matches_one_shard(group):
    _, shards, reference = group
    assert generate(shards.sockets, SAMPLED) == reference.sampled


def test_speculation_gives_every_rank_the_tokens_rank_0_kept(group):
    """Every rank drafts from the same tokens and appends what rank 0 kept
    (several tokens a step when drafts are accepted)."""
    _, shards, reference = group
    policy = DraftAlways(3)
    assert generate(shards.sockets, speculation=policy) == reference.greedy
    assert generate(shards.sockets, SAMPLED, speculation=DraftAlways(3)) == reference.sampled
    assert policy.total_accepted > 0


def test_logprobs_and_top_tokens_match_one_shard(group):
    _, shards, reference = group
    gen, ref = logprob_step(shards.sockets), reference.step
    assert gen.token_id == ref.token_id and gen.logprob == pytest.approx(ref.logprob, abs=1e-4)
    assert [t.token_id for t in gen.top_tokens] == [t.token_id for t in ref.top_tokens]
    assert [t.logprob for t in gen.prefill_tokens[1:]] == pytest.approx(
        [t.logprob for t in ref.prefill_tokens[1:]], abs=1e-4)


def test_info_reports_rank_world_size_and_kv_heads_per_rank(group):
    name, shards, _ = group
    kwargs, world_size = MODELS[name]
    infos = [call([s], lambda c: c.info()) for s in shards.sockets]
    assert [(i.rank, i.world_size) for i in infos] == [(r, world_size) for r in range(world_size)]
    assert {i.num_kv_heads for i in infos} == {max(1, kwargs["num_key_value_heads"] // world_size)}


def test_each_rank_holds_a_world_size_share_of_the_weights(group):
    name, shards, reference = group
    world_size = MODELS[name][1]
    for rank in range(world_size):
        held = int(re.search(r"\((\d+) bytes\)", shards.log(rank)).group(1))
        # Norms, vocabulary padding, replicated kv heads (6% of the tiny
        # "mqa" model) and the float32 GEMM's padding of a slice's output rows
        # to a multiple of 16 (2% there; none where the slices are whole
        # blocks, as in real models) are the only excess.
        assert reference.weight_bytes / world_size <= held <= 1.09 * reference.weight_bytes / world_size


def test_the_kv_cache_holds_only_the_rank_s_kv_heads(group):
    name, shards, _ = group
    kwargs, world_size = MODELS[name]
    warm = call(shards.sockets, lambda c: c.warmup(64, 4, kv_cache_bytes=1 << 20))
    per_block = 2 * 2 * max(1, kwargs["num_key_value_heads"] // world_size) * 8 * 16 * 4  # K+V, layers, heads, dim
    assert warm.num_blocks == (1 << 20) // per_block - 1


EOS = 257  # the tiny served model's </s>
REGEX_GRAMMAR = llguidance.LLMatcher.grammar_from_regex(r"[0-9]{3}-[a-z]{2}")


def constrained(sockets, speculation=None, grammar: str = REGEX_GRAMMAR) -> list[list[int]]:
    params = [greedy(grammar=grammar), greedy(do_sample=True, seed=5, grammar=grammar)]
    seqs = asyncio.run(run_prompts(sockets, [[256, 40, 70], [256, 41, 73, 9]], 24, params=params, stop_ids=(EOS,),
                                   speculation=speculation))
    return [s.generated_ids for s in seqs]


@pytest.fixture(scope="module")
def served(llama):
    """(two ranks of a tiny model with a tokenizer, one shard's constrained
    answers, the model's path): the "llama" group's."""
    shards, reference, path = llama
    return shards, reference.constrained, path


def test_grammars_constrain_tokens_as_on_one_shard(served):
    shards, expected, _ = served
    assert all(len(tokens) == 7 and tokens[-1] == EOS for tokens in expected)  # 6 characters, then EOS
    assert constrained(shards.sockets) == expected
    # With drafts (a text that repeats itself): rank 0 alone knows how many
    # the grammar allows, and every rank cuts there.
    repeats = llguidance.LLMatcher.grammar_from_regex(r"(ab-){6}")
    policy = DraftAlways(3)
    assert constrained(shards.sockets, policy, repeats) == constrained(shards.sockets, None, repeats)
    assert policy.total_accepted > 0


def test_a_grammar_rank_0_rejects_fails_the_step_on_every_rank_and_the_group_goes_on(served):
    shards, expected, _ = served
    call(shards.sockets, lambda c: c.warmup(64, 4))

    def step(grammar: str) -> pb.StepRequest:
        return pb.StepRequest(new_sequences=[pb.NewSequence(
            id=1, token_ids=[256, 40, 70], num_scheduled_tokens=3, block_table=[0],
            parameters=greedy(grammar=grammar))])
    with pytest.raises(ShardError) as err:
        call(shards.sockets, lambda c: c.step(step("not a grammar {")))
    assert err.value.code is StatusCode.INVALID_ARGUMENT and "does not compile" in err.value.details
    # Had rank 1 gone on to the forward alone, the ranks' collectives would now be
    # out of step, and sequence 1 would be live on rank 1 only.
    assert call(shards.sockets, lambda c: c.step(step(REGEX_GRAMMAR))).generations[0].token_id == expected[0][0]
    call(shards.sockets, lambda c: c.clear_cache())


def test_a_draft_model_sharded_like_the_target_gives_its_tokens(served, tmp_path):
    """--speculative-model over two ranks: each rank runs its slice of the
    draft, all propose the same drafts, and the tokens are one shard's."""
    shards, _, target = served
    draft = save_tiny_served_model(tmp_path / "draft", seed=8, num_hidden_layers=1)
    prompts = [[256] + list(b"abcabcabcabc"), [256] + list(b"hello world, hello")]
    expected = [s.generated_ids for s in asyncio.run(run_prompts(shards.sockets, prompts, 16))]
    policy = DraftAlways(3)
    with ShardProcesses(tmp_path, str(target), 2, "--speculative-model", str(draft)) as drafting:
        got = asyncio.run(run_prompts(drafting.sockets, prompts, 16, speculation=policy))
        assert "speculative model" in drafting.log(1)
    assert [s.generated_ids for s in got] == expected and policy.total_drafted > 0


@pytest.mark.slow
def test_smollm2_over_three_ranks_matches_one_shard(tmp_path):
    """The real GGUF file (9 heads, 3 kv heads; its Q4_1 linears run by the
    int4 kernel), each rank holding its slices: greedy and seeded sampled
    tokens are one shard's. The seeded half was checked over HTTP through the
    launcher before (tests/e2e/test_tensor_parallel_http.py), in float64:
    there concurrent requests made batches that varied from run to run, and
    in float32 the ranks' partial sums (added in another order than one
    GEMM's) once moved a draw across a boundary of the distribution. Here
    both sides run the same batches in the same order, so every run makes
    the same draws from the same logits. The launcher and router around N
    ranks stay covered there, with the tiny model."""
    prompts = [[1, 9690, 28, 30, 2, 198] + list(range(300, 340)), list(range(1000, 1100))]
    params = [greedy(), greedy()] + [greedy(do_sample=True, seed=7 + i, temperature=0.8) for i in range(2)]

    def tokens(sockets) -> list[list[int]]:
        return [s.generated_ids for s in asyncio.run(run_prompts(sockets, prompts * 2, 12, params=params))]
    with torch_threads(1), InProcessShard(tmp_path, str(default_model_path())) as one:
        expected = tokens(one.socket)
    assert expected[2:] != expected[:2]  # the draws are not the greedy tokens
    with ShardProcesses(tmp_path, str(default_model_path()), 3) as shards:
        assert tokens(shards.sockets) == expected


@pytest.mark.slow
def test_four_ranks_sharing_two_kv_heads_match_one_shard(tmp_path):
    path = save_tiny_model("llama", tmp_path / "m", num_attention_heads=8, num_key_value_heads=2, seed=5)
    with torch_threads(1), InProcessShard(tmp_path, str(path)) as shard:
        expected = generate(shard.socket)
    with ShardProcesses(tmp_path, str(path), 4) as shards:
        assert generate(shards.sockets) == expected
        assert {call([s], lambda c: c.info()).num_kv_heads for s in shards.sockets} == {1}


def test_a_head_count_that_does_not_split_exits_1_with_one_line(tmp_path):
    path = save_tiny_model("llama", tmp_path / "m", hidden_size=72, num_attention_heads=9, num_key_value_heads=3)
    # Rank 0 alone: the check comes before the group forms, so it waits for no peer.
    result = subprocess.run([sys.executable, "-m", "tgi_server.cli", "serve", str(path), "--uds-path",
                             str(tmp_path / "s")], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "RANK": "0", "WORLD_SIZE": "2",
                                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["error: cannot shard 9 attention heads over 2 shards"]


@pytest.mark.parametrize("heads, kv_heads, intermediate, world_size, message", [
    (9, 3, 128, 2, "cannot shard 9 attention heads over 2 shards"),
    (6, 3, 128, 2, "cannot shard 3 key-value heads over 2 shards"),
    (6, 6, 100, 3, "cannot shard an intermediate size of 100 over 3 shards"),
])
def test_sizes_that_do_not_split_are_named(tmp_path, heads, kv_heads, intermediate, world_size, message):
    path = save_tiny_model("llama", tmp_path / "m", hidden_size=8 * heads, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, intermediate_size=intermediate)
    config, _ = open_checkpoint(resolve_model(str(path)), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=message):
        config.check_tensor_parallel(world_size)
    config.check_tensor_parallel(1)


@pytest.mark.parametrize("heads, kv_heads, world_size, expected", [
    (8, 4, 2, [(4, 2, 0, 0), (4, 2, 4, 2)]),
    # 2 kv heads over 4 ranks: ranks 0-1 keep kv head 0, ranks 2-3 kv head 1.
    (8, 2, 4, [(2, 1, 0, 0), (2, 1, 2, 0), (2, 1, 4, 1), (2, 1, 6, 1)]),
    (6, 1, 3, [(2, 1, 0, 0), (2, 1, 2, 0), (2, 1, 4, 0)]),
])
def test_each_rank_keeps_the_kv_heads_its_query_heads_read(heads, kv_heads, world_size, expected):
    shards = [HeadShard.of_rank(heads, kv_heads, TensorParallel(rank, world_size)) for rank in range(world_size)]
    assert [(s.num_heads, s.num_kv_heads, s.q_start, s.kv_start) for s in shards] == expected
    group = heads // kv_heads  # query heads per kv head in the checkpoint
    for s in shards:
        read = {h // group for h in range(s.q_start, s.q_start + s.num_heads)}
        assert read == set(range(s.kv_start, s.kv_start + s.num_kv_heads))


def test_rank_slices_put_together_are_the_whole_checkpoint(tmp_path):
    """Loading needs no peer: build every rank's slice in this process."""
    path = save_tiny_model("qwen2", tmp_path / "m", num_attention_heads=8, num_key_value_heads=4)
    source = resolve_model(str(path))

    def model(rank: int, world_size: int):
        config, weights = open_checkpoint(source, torch.float32, torch.device("cpu"))
        return load_model(config, weights, TensorParallel(rank, world_size)).model

    whole, ranks = model(0, 1), [model(r, 2) for r in range(2)]
    attn = [m.layers[1].self_attn for m in (whole, *ranks)]
    # qkv rows per rank: its q heads, then its k heads, then its v heads (head_dim 8).
    q, k, v = whole.layers[1].self_attn.qkv.dense_weight().split([64, 32, 32])
    for rank, a in enumerate(attn[1:]):
        expected = torch.cat([q[32 * rank:32 * (rank + 1)], k[16 * rank:16 * (rank + 1)], v[16 * rank:16 * (rank + 1)]])
        assert torch.equal(a.qkv.dense_weight(), expected) and a.qkv.bias.shape == (64,)
    assert torch.equal(torch.cat([a.o_proj.dense_weight() for a in attn[1:]], dim=1), attn[0].o_proj.dense_weight())
    assert attn[1].o_proj.reduce is not None and attn[0].o_proj.reduce is None
    assert torch.equal(torch.cat([m.embed_tokens.weight for m in ranks]), whole.embed_tokens.weight)
    mlp = [m.layers[0].mlp for m in ranks]
    assert torch.equal(torch.cat([m.down.dense_weight() for m in mlp], dim=1), whole.layers[0].mlp.down.dense_weight())
    assert sum(weight_bytes(m) for m in ranks) == pytest.approx(weight_bytes(whole), rel=0.01)


def test_weight_bytes_count_prepacked_bf16_weights(tmp_path):
    import transformers

    path = save_tiny_model("llama", tmp_path / "m", num_attention_heads=8, num_key_value_heads=4)
    numel = sum(p.numel() for p in transformers.LlamaForCausalLM.from_pretrained(path).parameters())
    source = resolve_model(str(path))

    def held(rank: int, world_size: int) -> int:
        config, weights = open_checkpoint(source, torch.bfloat16, torch.device("cpu"))
        return load_model(config, weights, TensorParallel(rank, world_size)).weight_bytes

    assert held(0, 1) == 2 * numel
    assert held(0, 2) + held(1, 2) == pytest.approx(2 * numel, rel=0.01)


def test_the_vocabulary_split_pads_the_last_rank_with_zero_rows(tmp_path):
    path = save_tiny_model("llama", tmp_path / "m", vocab_size=250)
    source = resolve_model(str(path))
    config, weights = open_checkpoint(source, torch.float32, torch.device("cpu"))
    whole = load_model(config, weights, TensorParallel()).model.lm_head.proj.dense_weight()  # [250, 64]
    heads = []
    for rank in range(4):
        config, weights = open_checkpoint(source, torch.float32, torch.device("cpu"))
        heads.append(load_model(config, weights, TensorParallel(rank, 4)).model.lm_head.proj.dense_weight())
    assert [h.shape[0] for h in heads] == [63] * 4  # ceil(250 / 4)
    padded = torch.cat(heads)
    assert torch.equal(padded[:250], whole) and not padded[250:].any()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_nccl_group_matches_one_gpu(tmp_path, name):
    kwargs, _ = MODELS[name]
    path = save_tiny_model(**kwargs, path=tmp_path / "model", seed=3)
    args = ("--attention-backend", "sdpa")  # float32 end to end: no flash-attn rounding
    with ShardProcesses(tmp_path, str(path), 1, *args, device="cuda") as one:
        expected = generate(one.sockets), generate(one.sockets, SAMPLED)
    with ShardProcesses(tmp_path, str(path), 2, *args, device="cuda") as two:
        infos = [call([s], lambda c: c.info()) for s in two.sockets]
        assert [i.device for i in infos] == ["cuda:0", "cuda:1"]
        assert (generate(two.sockets), generate(two.sockets, SAMPLED)) == expected
