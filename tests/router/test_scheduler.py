"""The scheduler and block manager, with fake shard answers (no model)."""

import pytest

from tgi_proto import pb
from tgi_router.scheduling.block_manager import BlockManager
from tgi_router.scheduling.scheduler import Scheduler
from tgi_router.scheduling.sequence import FinishReason, Sequence, Status, StoppingCriteria
from tgi_router.scheduling.step_budget import StepBudget


def seq(i: int, n: int, max_new: int = 4, stop=()) -> Sequence:
    """A prompt of n tokens sharing no prefix with other ids' prompts."""
    return Sequence(id=i, token_ids=list(range(100 * i, 100 * i + n)), params=pb.SamplingParameters(),
                    stopping=StoppingCriteria(max_new, frozenset(stop)))


def answer(step, token: int = 7) -> pb.StepResponse:
    """Samples `token` for every sequence whose step reaches its last token."""
    return pb.StepResponse(generations=[
        pb.Generation(id=s.id, sampled=s.num_computed + n == len(s.token_ids), token_id=token)
        for s, n in step.seqs])


def test_the_budget_bounds_prompt_chunks_by_the_prompt_allowance_and_decodes_by_the_step_only():
    budget = StepBudget(tokens=10, prompt=4)
    assert budget.offer(1) == 1 and budget.offer(7) == 4 and budget.offer(3) == 3
    budget.take(7, 4)  # a prompt's chunk
    assert (budget.tokens, budget.prompt) == (6, 0)
    assert budget.offer(7) == 0 and budget.offer(1) == 1  # no prompt tokens left; a decode still fits
    budget.take(1, 1)
    assert (budget.tokens, budget.prompt) == (5, 0)
    budget.tokens = 0
    assert budget.offer(1) == 0


def test_block_manager_allocates_and_frees():
    bm = BlockManager(4, 16)
    a = bm.allocate(3)
    assert sorted(a) == [0, 1, 2] and bm.num_free == 1
    assert bm.allocate(2) is None and bm.num_free == 1
    bm.free(a)
    assert bm.num_free == 4
    with pytest.raises(ValueError):
        bm.free([0])


def test_running_first_then_waiting_under_budget():
    s = Scheduler(BlockManager(64, 4), max_batch_tokens=10)
    a, b = seq(1, 6), seq(2, 8)
    s.add(a)
    s.add(b)
    step = s.schedule()
    assert [(x.id, n) for x, n in step.seqs] == [(1, 6), (2, 4)]  # b's prompt is chunked
    s.update(step, answer(step))
    step = s.schedule()
    assert [(x.id, n) for x, n in step.seqs] == [(1, 1), (2, 4)]
    assert len(a.block_table) == 2 and len(b.block_table) == 2


def test_deltas_carry_only_new_blocks_the_shard_keeps_its_sampled_tokens():
    s = Scheduler(BlockManager(64, 4), max_batch_tokens=64)
    a = seq(1, 4)
    s.add(a)
    step = s.schedule()
    first = s.to_request(step, 1)
    assert len(first.new_sequences) == 1 and first.new_sequences[0].block_table == [0]
    s.update(step, answer(step, token=99))
    step = s.schedule()
    second = s.to_request(step, 2)
    assert not second.new_sequences
    (r,) = second.running
    assert list(r.new_block_ids) == [1] and r.num_scheduled_tokens == 1 and second.after_step_id == 0
    assert a.token_ids[-1] == 99  # the router keeps it for text and stopping, never sends it back


def test_finish_frees_blocks_and_releases_on_next_step():
    bm = BlockManager(8, 4)
    s = Scheduler(bm, max_batch_tokens=64)
    a = seq(1, 5, max_new=1)
    s.add(a)
    step = s.schedule()
    s.to_request(step, 1)
    finished = s.update(step, answer(step))
    assert finished == [a] and a.status is Status.FINISHED and a.finish_reason is FinishReason.LENGTH
    assert bm.num_used == 0 and bm.num_cached == 1 and bm.num_free == 7  # its full block stays cached
    assert s.schedule().release_ids == [1]


def test_eos_stops_unless_ignored():
    s = Scheduler(BlockManager(8, 4), max_batch_tokens=64)
    a = seq(1, 3, max_new=10, stop=[7])
    s.add(a)
    step = s.schedule()
    s.to_request(step, 1)
    assert s.update(step, answer(step, token=7)) == [a]
    assert a.finish_reason is FinishReason.EOS_TOKEN


def test_waiting_sequence_waits_for_blocks_in_order():
    bm = BlockManager(3, 4)
    s = Scheduler(bm, max_batch_tokens=64)
    big, small = seq(1, 12), seq(2, 2)
    s.add(seq(3, 8))
    s.add(big)
    s.add(small)
    step = s.schedule()
    assert [x.id for x, _ in step.seqs] == [3]  # big does not fit; small may not overtake it
    assert list(s.waiting) == [big, small]


def test_length_wins_over_eos_on_the_last_token():
    s = Scheduler(BlockManager(8, 4), max_batch_tokens=64)
    a = seq(1, 3, max_new=1, stop=[7])
    s.add(a)
    step = s.schedule()
    s.to_request(step, 1)
    s.update(step, answer(step, token=7))
    assert a.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("complete, reason", [(True, FinishReason.EOS_TOKEN), (False, FinishReason.LENGTH)])
def test_a_grammar_completed_by_the_last_token_is_an_end_not_a_cut(complete, reason):
    s = Scheduler(BlockManager(8, 4), max_batch_tokens=64)
    a = seq(1, 3, max_new=1)
    s.add(a)
    step = s.schedule()
    s.to_request(step, 1)
    response = answer(step, token=9)
    response.generations[0].grammar_complete = complete
    s.update(step, response)
    assert a.finish_reason is reason


def test_preemption_frees_the_latest_and_recomputes_it_later():
    bm = BlockManager(4, 4)
    s = Scheduler(bm, max_batch_tokens=64)
    a, b = seq(1, 8, max_new=20), seq(2, 8, max_new=20)
    s.add(a)
    s.add(b)
    step = s.schedule()  # 2 blocks each: all 4 used
    s.to_request(step, 1)
    s.update(step, answer(step))  # both now 9 tokens: computing the 9th needs a third block
    step = s.schedule()
    assert [x.id for x, _ in step.seqs] == [1] and b.status is Status.WAITING and s.num_preemptions == 1
    assert step.release_ids == [2] and b.num_computed == 0 and len(b.token_ids) == 9
    req = s.to_request(step, 2)
    s.update(step, answer(step))
    s.finish(a, FinishReason.LENGTH)
    step = s.schedule()
    (new,) = s.to_request(step, 3).new_sequences
    assert new.id == 2 and list(new.token_ids) == b.token_ids and new.prompt_length == 8
    # b's first block was still cached (its second, freed first, was evicted for a's third)
    assert new.num_computed_tokens == 4 and new.num_scheduled_tokens == 5 and req.running[0].id == 1


def test_waiting_served_ratio_and_max_waiting_tokens():
    s = Scheduler(BlockManager(64, 4), max_batch_tokens=64, waiting_served_ratio=1.0, max_waiting_tokens=3)
    for i in range(1, 3):
        s.add(seq(i, 2, max_new=50))
    s.update(step := s.schedule(), answer(step))
    s.add(seq(9, 2, max_new=50))
    joins = []
    for _ in range(4):
        step = s.schedule()
        s.update(step, answer(step))
        joins.append(any(x.id == 9 for x, n in step.seqs if n == 2))
    # 1 waiting < 1.0 x 2 running: it waits until 3 steps passed since the last join
    assert joins == [False, False, True, False]
