"""Many sequences of different lengths, arriving at different steps and
stepped together, give the same tokens as each one alone."""

import asyncio
import random

import pytest

from tgi_proto import pb

from ..shard_harness import InProcessShard, run_prompts, save_tiny_model


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inv")
    path = save_tiny_model("llama", tmp / "llama", seed=1)
    with InProcessShard(tmp, str(path)) as s:
        yield s


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(1, 70))] for _ in range(n)]


def alone(socket, prompt, params=None, new=24):
    return asyncio.run(run_prompts(socket, [prompt], new, params=[params] if params else None))[0].generated_ids


def test_sixteen_staggered_sequences_match_alone(shard):
    ps = prompts(16)
    arrivals = [i % 5 * 3 for i in range(16)]
    batched = asyncio.run(run_prompts(shard.socket, ps, 24, arrivals=arrivals))
    assert [s.generated_ids for s in batched] == [alone(shard.socket, p) for p in ps]


def test_chunked_prefill_matches_whole_prefill(shard):
    """A step budget of 16 tokens splits long prompts over several steps,
    mixed with the decodes of the others."""
    ps = prompts(6, seed=2)
    chunked = asyncio.run(run_prompts(shard.socket, ps, 16, max_batch_tokens=16))
    whole = asyncio.run(run_prompts(shard.socket, ps, 16))
    assert [s.generated_ids for s in chunked] == [s.generated_ids for s in whole]


def test_seeded_sampling_same_alone_and_in_batch(shard):
    ps = prompts(8, seed=4)
    params = [pb.SamplingParameters(do_sample=True, temperature=0.9, top_k=50, top_p=0.95, seed=1000 + i)
              for i in range(8)]
    batched = asyncio.run(run_prompts(shard.socket, ps, 20, params=params, arrivals=[i for i in range(8)]))
    assert [s.generated_ids for s in batched] == [alone(shard.socket, p, q, 20) for p, q in zip(ps, params)]


def test_different_seeds_give_different_text(shard):
    p = prompts(1, seed=5)[0]
    a = alone(shard.socket, p, pb.SamplingParameters(do_sample=True, temperature=1.5, seed=1), 20)
    b = alone(shard.socket, p, pb.SamplingParameters(do_sample=True, temperature=1.5, seed=2), 20)
    assert a != b


def test_preemption_under_a_small_kv_cache_changes_nothing(tmp_path, shard):
    """40 blocks for 16 sequences that need ~90: the scheduler preempts and
    recomputes, and every sequence still gives its tokens alone."""
    path = save_tiny_model("llama", tmp_path / "llama", seed=1)
    ps = prompts(16)
    stats = {}
    with InProcessShard(tmp_path, str(path), kv_cache_bytes=41 * 8192) as small:
        batched = asyncio.run(run_prompts(small.socket, ps, 24, arrivals=[i % 4 for i in range(16)], stats=stats))
    assert stats["preemptions"] > 0
    assert [s.generated_ids for s in batched] == [alone(shard.socket, p) for p in ps]
