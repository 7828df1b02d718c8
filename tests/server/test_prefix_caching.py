"""Prefix caching and chunked prefill change no token: 50 greedy requests
sharing prefixes of assorted lengths give the same ids with caching on and
off, and with step budgets of 16, 64 and 512 tokens; prompt logprobs come
back whole when the prompt is chunked. Tiny random llama, 16-token blocks."""

import asyncio
import math
import random

import pytest

from tgi_proto import pb
from tgi_router.scheduling.block_manager import BlockManager
from tgi_router.scheduling.client import ShardClient
from tgi_router.scheduling.scheduler import Scheduler
from tgi_router.scheduling.sequence import Sequence, StoppingCriteria

from ..shard_harness import InProcessShard, run_prompts, save_tiny_model

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefix")
    path = save_tiny_model("llama", tmp / "llama", seed=3)
    with InProcessShard(tmp, str(path)) as s:
        yield s


def shared_prefix_prompts(n: int = 50, seed: int = 0) -> list[list[int]]:
    """Prompts built on three system prompts, cut at lengths on and off the
    16-token block boundaries, plus the same prompt twice (a full hit, also
    on a boundary: 32 tokens) and unrelated ones."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 256) for _ in range(100)] for _ in range(3)]
    prompts = [systems[0][:32], systems[0][:32], systems[1][:40], systems[1][:40]]
    while len(prompts) < n:
        kind = rng.random()
        if kind < 0.1:
            prompts.append([rng.randrange(3, 256) for _ in range(rng.randint(1, 60))])
        elif kind < 0.25:
            prompts.append(list(rng.choice(prompts)))  # an earlier prompt again
        else:
            cut = rng.choice((1, 15, 16, 17, 31, 32, 33, 47, 48, 64, 70, 100))
            suffix = [rng.randrange(3, 256) for _ in range(rng.randint(0, 20))]
            prompts.append(rng.choice(systems)[:cut] + suffix)
    return prompts


def generate(socket: str, prompts: list[list[int]], budget: int, caching: bool, stats: dict | None = None):
    arrivals = [i // 4 * 2 for i in range(len(prompts))]  # batches of four, every other step
    seqs = asyncio.run(run_prompts(socket, prompts, NEW_TOKENS, max_batch_tokens=budget, arrivals=arrivals,
                                   stats=stats, prefix_caching=caching))
    return [s.generated_ids for s in seqs]


@pytest.fixture(scope="module")
def reference(shard) -> list[list[int]]:
    """Every prompt computed whole: no caching, no chunking."""
    return generate(shard.socket, shared_prefix_prompts(), 4096, caching=False)


@pytest.mark.parametrize("budget", [512, 64, 16])
def test_caching_and_chunking_give_the_same_greedy_tokens(shard, reference, budget):
    stats = {}
    assert generate(shard.socket, shared_prefix_prompts(), budget, caching=True, stats=stats) == reference
    assert stats["hit_tokens"] >= 16 * 30  # the cache did serve most requests


def test_chunking_without_caching_gives_the_same_greedy_tokens(shard, reference):
    assert generate(shard.socket, shared_prefix_prompts(), 16, caching=False) == reference


async def prompt_logprobs(socket: str, prompts: list[list[int]], budget: int) -> list[list[float]]:
    """Prompt logprobs of each prompt, gathered chunk by chunk."""
    client = ShardClient([socket], timeout=120)
    try:
        warm = await client.warmup(256, 64)
        scheduler = Scheduler(BlockManager(warm.num_blocks, warm.block_size), budget)
        seqs = [Sequence(id=i + 1, token_ids=list(p), stopping=StoppingCriteria(1),
                         params=pb.SamplingParameters(prefill_logprobs=True)) for i, p in enumerate(prompts)]
        out: dict[int, list[float]] = {s.id: [] for s in seqs}
        for s in seqs:
            scheduler.add(s)
        step_id = 0
        while scheduler.has_work():
            step = scheduler.schedule()
            step_id += 1
            response = await client.step(scheduler.to_request(step, step_id))
            for gen in response.generations:
                out[gen.id].extend(t.logprob for t in gen.prefill_tokens)
            scheduler.update(step, response)
        return [out[s.id] for s in seqs]
    finally:
        await client.close()


def test_prompt_logprobs_are_whole_when_chunked_and_cached(shard):
    prompts = shared_prefix_prompts(8, seed=1)
    whole = asyncio.run(prompt_logprobs(shard.socket, prompts, 4096))
    chunked = asyncio.run(prompt_logprobs(shard.socket, prompts, 16))
    assert [len(x) for x in chunked] == [len(p) for p in prompts]
    for a, b in zip(whole, chunked):
        assert math.isnan(a[0]) and math.isnan(b[0])
        assert a[1:] == pytest.approx(b[1:], abs=1e-4)
