"""The block manager's prefix cache, and its books under random load (no model)."""

import random
from collections import Counter

import pytest

from tgi_proto import pb
from tgi_router.scheduling.block_manager import ROOT_HASH, BlockManager, chain_hashes, hash_block
from tgi_router.scheduling.scheduler import Scheduler
from tgi_router.scheduling.sequence import FinishReason, Sequence, Status, StoppingCriteria

from .fake_kv_shard import FakeKVShard


def check_books(bm: BlockManager, live: list[Sequence], seen_hashes: set[int]) -> None:
    """Each block is in one state, and the counts of each are the books':
    cached + free + used == total; every block's reference count equals its
    uses in the live block tables, and the used blocks are those in a table;
    cached blocks are exactly the unreferenced registered ones. A registered
    block's hash finds it; any hash seen registered before (`seen_hashes`,
    extended here) finds nothing or the block registered under it now."""
    uses = Counter(b for s in live for b in s.block_table)
    states = [bm.state(b) for b in range(bm.num_blocks)]
    assert Counter(states) == Counter(free=bm.num_free, cached=bm.num_cached, used=bm.num_used)
    assert bm.num_free + bm.num_cached + bm.num_used == bm.num_blocks
    assert [bm.ref_count(b) for b in range(bm.num_blocks)] == [uses[b] for b in range(bm.num_blocks)]
    assert [state == "used" for state in states] == [uses[b] > 0 for b in range(bm.num_blocks)]
    hashes = [bm.registered_hash(b) for b in range(bm.num_blocks)]
    for block, (state, h) in enumerate(zip(states, hashes)):
        if state != "used":
            assert (state == "cached") == (h is not None), f"block {block} is {state}, registered as {h}"
    registered = {h: b for b, h in enumerate(hashes) if h is not None}
    assert len(registered) == len(hashes) - hashes.count(None), "a hash registered by two blocks"
    seen_hashes.update(registered)
    for h in seen_hashes:
        assert bm.lookup([h]) == ([registered[h]] if h in registered else []), f"hash {h} finds the wrong block"


def test_equal_blocks_after_different_prefixes_hash_differently():
    assert hash_block(ROOT_HASH, [5, 6]) != hash_block(hash_block(ROOT_HASH, [1, 2]), [5, 6])
    a, b = [], []
    chain_hashes([1, 2, 5, 6, 9], 2, a, 2)
    chain_hashes([3, 4, 5, 6], 2, b, 2)
    assert len(a) == 2 and a[1] != b[1]


def test_allocation_takes_free_blocks_before_evicting_cached_ones():
    bm = BlockManager(4, 2)
    a = bm.allocate(2)
    bm.register(a[0], 11)
    bm.free(a)
    assert (bm.num_free, bm.num_cached, bm.num_used) == (3, 1, 0)
    assert a[0] not in bm.allocate(3)  # the three never-cached blocks first
    assert bm.allocate(1) == [a[0]] and bm.lookup([11]) == []  # then eviction forgets the hash


def test_eviction_is_least_recently_used_and_spares_referenced_blocks():
    bm = BlockManager(3, 2)
    blocks = bm.allocate(3)
    for b, h in zip(blocks, (1, 2, 3)):
        bm.register(b, h)
    bm.free([blocks[1]])
    bm.free([blocks[0]])  # now cached: blocks[1] (older), then blocks[0]; blocks[2] still used
    assert bm.allocate(1) == [blocks[1]]
    assert bm.allocate(1) == [blocks[0]]
    assert bm.allocate(1) is None and bm.lookup([3]) == [blocks[2]]


def test_lookup_finds_the_longest_cached_run_and_share_counts_references():
    bm = BlockManager(4, 2)
    blocks = bm.allocate(3)
    for b, h in zip(blocks, (7, 8, 9)):
        bm.register(b, h)
    bm.free(blocks)
    assert bm.num_cached == 3
    assert bm.lookup([7, 8, 42, 9]) == blocks[:2]
    bm.share(blocks[:2])
    bm.share(blocks[:1])
    assert [bm.ref_count(b) for b in blocks] == [2, 1, 0] and bm.num_cached == 1 and bm.num_used == 2
    bm.free(blocks[:1])
    bm.free(blocks[:2])
    assert bm.num_used == 0 and bm.num_cached == 3


def test_a_hash_computed_twice_keeps_its_first_block():
    bm = BlockManager(2, 2)
    a, b = bm.allocate(2)
    bm.register(a, 5)
    bm.register(b, 5)
    bm.free([a, b])
    assert bm.lookup([5]) == [a] and bm.num_cached == 1 and bm.num_free == 1


def test_freeing_an_unreferenced_block_is_refused():
    bm = BlockManager(2, 2)
    (a,) = bm.allocate(1)
    bm.free([a])
    with pytest.raises(ValueError):
        bm.free([a])


def test_without_prefix_caching_nothing_is_registered():
    bm = BlockManager(2, 2, prefix_caching=False)
    (a,) = bm.allocate(1)
    bm.register(a, 5)
    bm.free([a])
    assert bm.lookup([5]) == [] and bm.num_free == 2 and bm.num_cached == 0


class RandomLoad:
    """Requests sharing a few prefixes (best_of copies, prompt-logprob ones
    among them) arrive at random, some are cancelled between steps or while
    a step is in flight, in a cache small enough to force eviction and
    preemption. The books are checked after every change."""

    def __init__(self, seed: int):
        self.rng = rng = random.Random(seed)
        self.bm = BlockManager(rng.randint(10, 16), 4, prefix_caching=seed % 5 != 4)
        self.scheduler = Scheduler(self.bm, max_batch_tokens=rng.choice([4, 7, 16, 64]),
                                   max_batch_size=rng.choice([0, 3]))
        self.shard = FakeKVShard(self.bm)
        self.prefixes = [[rng.randrange(3, 60) for _ in range(20)] for _ in range(3)]
        self.seqs: list[Sequence] = []
        self.hit_tokens = 0
        self.seen_hashes: set[int] = set()

    def live(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status is not Status.FINISHED]

    def check(self) -> None:
        assert all(not s.block_table for s in self.scheduler.waiting)
        check_books(self.bm, self.live(), self.seen_hashes)

    def arrive(self) -> None:
        rng = self.rng
        prompt = rng.choice(self.prefixes)[:rng.randint(1, 20)] + [rng.randrange(3, 60)
                                                                   for _ in range(rng.randint(0, 12))]
        params = pb.SamplingParameters(prefill_logprobs=rng.random() < 0.1)
        for _ in range(rng.choice((1, 1, 1, 2))):  # best_of copies arrive together
            seq = Sequence(id=len(self.seqs) + 1, token_ids=list(prompt), params=params,
                           stopping=StoppingCriteria(rng.randint(1, 8)))
            self.seqs.append(seq)
            self.scheduler.add(seq)

    def cancel_one(self, among: list[Sequence]) -> None:
        candidates = [s for s in among if s.status is not Status.FINISHED]
        if candidates:
            self.scheduler.finish(self.rng.choice(candidates), FinishReason.CANCELLED)
            self.check()

    def step(self, step_id: int) -> None:
        step = self.scheduler.schedule()
        self.check()
        if not step.seqs:
            assert not self.scheduler.has_work(), "stalled with work left"
            self.shard.step(pb.StepRequest(release_ids=step.release_ids + self.scheduler.take_releases()))
            return
        request = self.scheduler.to_request(step, step_id)
        if self.rng.random() < 0.05:
            self.cancel_one([s for s, _ in step.seqs])  # the step is already on its way
        self.scheduler.update(step, self.shard.step(request))
        self.check()


def run_load(seed: int, steps: int = 250) -> RandomLoad:
    """Arrivals and cancellations for `steps` steps, then runs until done;
    `hit_tokens` sums the prefix-cache hits."""
    load = RandomLoad(seed)
    for step_id in range(1, steps):
        for _ in range(load.rng.choice((0, 0, 0, 1, 2))):
            load.arrive()
        if load.rng.random() < 0.1:
            load.cancel_one(load.seqs)
        load.step(step_id)
        load.hit_tokens += load.scheduler.take_stats().hit_tokens
    while load.scheduler.has_work():
        step_id += 1
        load.step(step_id)
    return load


@pytest.mark.parametrize("seed", range(40))
def test_random_load_keeps_the_books_and_leaks_nothing(seed):
    load = run_load(seed)
    bm = load.bm
    assert bm.num_used == 0 and bm.num_free + bm.num_cached == bm.num_blocks
    assert all(s.status is Status.FINISHED for s in load.seqs)


def test_random_load_hits_the_cache_and_preempts():
    """The load above does exercise what it claims to."""
    loads = [run_load(seed, steps=120) for seed in range(8)]
    assert sum(load.hit_tokens for load in loads) > 0
    assert sum(load.scheduler.num_preemptions for load in loads) > 0
