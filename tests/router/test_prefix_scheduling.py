"""Prefix caching as the scheduler uses it, with a fake shard that checks
every K/V a sequence reads (no model). Blocks hold 4 tokens."""

from tgi_proto import pb
from tgi_router.scheduling.block_manager import BlockManager
from tgi_router.scheduling.scheduler import Scheduler
from tgi_router.scheduling.sequence import Sequence, Status, StoppingCriteria

from .fake_kv_shard import FakeKVShard

PROMPT = list(range(10, 20))  # 10 tokens: blocks [10..13] [14..17] and 2 tokens of a third


def seq(i: int, tokens: list[int], max_new: int = 1, prefill_logprobs: bool = False) -> Sequence:
    return Sequence(id=i, token_ids=list(tokens), params=pb.SamplingParameters(prefill_logprobs=prefill_logprobs),
                    stopping=StoppingCriteria(max_new))


class Rig:
    def __init__(self, num_blocks: int = 32, budget: int = 64, caching: bool = True):
        self.bm = BlockManager(num_blocks, 4, caching)
        self.scheduler = Scheduler(self.bm, budget)
        self.shard = FakeKVShard(self.bm)
        self.step_id = 0
        self.requests: list[pb.StepRequest] = []

    def step(self) -> list[tuple[Sequence, int]]:
        step = self.scheduler.schedule()
        self.step_id += 1
        request = self.scheduler.to_request(step, self.step_id)
        self.requests.append(request)
        self.scheduler.update(step, self.shard.step(request))
        return step.seqs

    def run(self, *seqs: Sequence) -> None:
        for s in seqs:
            self.scheduler.add(s)
        while self.scheduler.has_work():
            self.step()

    def new_sequence(self, seq_id: int) -> pb.NewSequence:
        return next(n for r in self.requests for n in r.new_sequences if n.id == seq_id)


def test_a_hit_ending_inside_a_block_reuses_the_whole_blocks_before_it():
    rig = Rig()
    a = seq(1, PROMPT)
    rig.run(a)
    a_blocks = rig.new_sequence(1).block_table[:2]
    rig.run(seq(2, PROMPT[:9] + [99, 98]))  # shares 9 tokens: 2 whole blocks and 1 token of the third
    b = rig.new_sequence(2)
    assert b.num_computed_tokens == 8 and b.num_scheduled_tokens == 3 and b.block_table[:2] == a_blocks


def test_a_whole_cached_prompt_still_computes_the_block_of_its_last_token():
    rig = Rig()
    rig.run(seq(1, PROMPT[:8]), seq(2, PROMPT[:9]))
    rig.run(seq(3, PROMPT[:8]), seq(4, PROMPT[:9]))
    eight, nine = rig.new_sequence(3), rig.new_sequence(4)
    assert (eight.num_computed_tokens, eight.num_scheduled_tokens) == (4, 4)  # never write a shared block
    assert (nine.num_computed_tokens, nine.num_scheduled_tokens) == (8, 1)


def test_sequences_sharing_a_prefix_reference_the_same_blocks():
    rig = Rig()
    rig.run(seq(1, PROMPT))
    b, c = seq(2, PROMPT, max_new=5), seq(3, PROMPT + [7], max_new=5)
    rig.scheduler.add(b)
    rig.scheduler.add(c)
    rig.step()
    shared = b.block_table[:2]
    assert c.block_table[:2] == shared and [rig.bm.ref_count(x) for x in shared] == [2, 2]
    rig.scheduler.finish(b, b.finish_reason)
    assert [rig.bm.ref_count(x) for x in shared] == [1, 1]


def test_best_of_copies_share_the_prompt_blocks():
    """The second copy waits one step for the first to fill the prompt's
    blocks, then takes them instead of computing them again."""
    rig = Rig()
    copies = [seq(1, PROMPT, max_new=3), seq(2, PROMPT, max_new=3)]
    for s in copies:
        rig.scheduler.add(s)
    assert [(s.id, n) for s, n in rig.step()] == [(1, 10)]
    assert [(s.id, n) for s, n in rig.step()] == [(1, 1), (2, 2)]
    assert copies[1].block_table[:2] == copies[0].block_table[:2]
    assert [rig.bm.ref_count(x) for x in copies[0].block_table[:2]] == [2, 2]
    rig.run()
    assert rig.shard.tokens_computed == 10 + 2 + 2 * 2  # the prompt once, then each copy's own tokens


def test_a_chunked_prompt_is_followed_rather_than_computed_twice():
    rig = Rig(budget=12)
    long = list(range(100, 120))
    a, b = seq(1, long, max_new=2), seq(2, long[:16] + [5, 6], max_new=2)
    rig.scheduler.add(a)
    rig.scheduler.add(b)
    assert [(s.id, n) for s, n in rig.step()] == [(1, 12)]
    assert [(s.id, n) for s, n in rig.step()] == [(1, 8)]  # b's next block is being filled: it waits
    assert [(s.id, n) for s, n in rig.step()] == [(1, 1), (2, 2)]
    assert rig.new_sequence(2).num_computed_tokens == 16


def test_prompt_logprobs_are_computed_never_hit():
    rig = Rig()
    rig.run(seq(1, PROMPT))
    rig.run(seq(2, PROMPT, prefill_logprobs=True))
    assert rig.new_sequence(2).num_computed_tokens == 0
    assert rig.scheduler.take_stats().queried_tokens == len(PROMPT)  # only the first asked the cache


def test_blocks_filled_while_decoding_are_registered():
    rig = Rig()
    a = seq(1, PROMPT[:3], max_new=7)
    rig.run(a)  # 3 + 7 tokens, 9 of them computed: two full blocks
    rig.run(seq(2, a.token_ids + [1, 2]))
    assert rig.new_sequence(2).num_computed_tokens == 8


def test_a_preempted_sequence_hits_its_own_cached_blocks():
    rig = Rig(num_blocks=6)
    a, b = seq(1, PROMPT, max_new=8), seq(2, list(range(50, 56)), max_new=8)
    rig.scheduler.add(a)
    rig.scheduler.add(b)
    for _ in range(4):  # 3 + 2 blocks + 1 free; a's 13th token takes it, b's 9th finds none
        rig.step()
    assert rig.scheduler.num_preemptions == 1 and b.status is Status.WAITING
    rig.run()
    again = [n for r in rig.requests for n in r.new_sequences if n.id == 2][-1]
    # b's second block, freed first, was evicted for a's fifth; its first was still cached
    assert again.num_computed_tokens == 4 and a.num_generated == b.num_generated == 8


def test_without_prefix_caching_nothing_is_reused():
    rig = Rig(caching=False)
    rig.run(seq(1, PROMPT))
    rig.run(seq(2, PROMPT))
    assert rig.new_sequence(2).num_computed_tokens == 0
    assert rig.bm.num_cached == 0 and rig.bm.num_free == rig.bm.num_blocks
    assert rig.scheduler.take_stats().queried_tokens == 0


def test_stats_count_queried_and_hit_tokens_and_chunks_per_prefill():
    rig = Rig(budget=4)
    rig.run(seq(1, PROMPT))
    rig.run(seq(2, PROMPT + [3]))
    stats = rig.scheduler.take_stats()
    assert stats.queried_tokens == 10 + 11 and stats.hit_tokens == 8
    assert stats.prefill_chunks == [3, 1]  # 4 + 4 + 2 tokens; then 3 after the 8 cached
    assert rig.scheduler.take_stats().prefill_chunks == []
