"""Speculation in the router (no model): the policy's rule, and the
scheduler and engine with a fake shard that drafts (some drafts right, some
wrong) and checks every K/V a sequence reads. Outputs must equal each
sequence run alone, whatever was accepted, with stops inside accepted runs,
preemption, chunked prompts and prefix caching; no block may leak."""

import asyncio
import random

import pytest

from tgi_proto import pb
from tgi_router.scheduling.block_manager import BlockManager
from tgi_router.scheduling.engine import Engine
from tgi_router.scheduling.scheduler import Scheduler
from tgi_router.scheduling.sequence import FinishReason, Sequence, Status, StoppingCriteria
from tgi_router.scheduling.speculation import PRIOR, PROBE_COST, START_RATE, SpeculationPolicy

from ..shard_harness import DraftAlways
from .fake_kv_shard import FakeKVShard, next_token
from .test_async_scheduling import SCENARIOS, Client, alone, seq


def drafter(tokens: list[int], k: int) -> list[int]:
    """k drafts, each the right token (next_token) 3 times in 4, else a wrong one; fewer at times."""
    out = []
    for i in range(k):
        h = hash(("draft", tuple(tokens), i))
        if h % 7 == 0:
            break  # the proposer found nothing more
        right = next_token(tokens + out)
        out.append(right if h % 4 else right + 1)
    return out


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("ahead", [True, False], ids=["pipelined", "in turn"])
def test_outputs_equal_each_sequence_alone_and_nothing_leaks(scenario, ahead):
    cfg = SCENARIOS[scenario]
    rng = random.Random(scenario)

    async def go():
        bm = BlockManager(cfg["num_blocks"], 4, cfg["caching"])
        scheduler = Scheduler(bm, max_batch_tokens=cfg["budget"], speculation=DraftAlways(3))
        shard = FakeKVShard(bm, drafter)
        engine = Engine(Client(shard), scheduler, plan_ahead=ahead)
        seqs = []
        for _ in range(400):
            if len(seqs) < 24 and rng.random() < 0.3:
                prompt = [rng.randrange(10, 60) for _ in range(rng.randrange(1, 12))]
                s = seq(len(seqs) + 1, prompt, rng.randrange(1, 30), eos=rng.random() < 0.7)
                s.prompt = list(prompt)
                seqs.append(s)
                scheduler.add(s)
            await engine.step()
            if len(seqs) >= 24 and engine.idle:
                break
        while not engine.idle:
            await engine.step()
        return bm, shard, seqs

    bm, shard, seqs = asyncio.run(go())
    assert len(seqs) == 24 and all(s.status is Status.FINISHED for s in seqs)
    for s in seqs:
        expected = alone(s.prompt, s.stopping.max_new_tokens, bool(s.stopping.stop_token_ids))
        assert s.generated_ids == expected, s.id
    assert bm.num_used == 0 and not shard.seqs
    assert shard.accepted > 20 and shard.drafted > shard.accepted  # runs accepted, and drafts rejected


def rig(budget: int = 64, num_blocks: int = 64) -> tuple[Scheduler, BlockManager]:
    bm = BlockManager(num_blocks, 4)
    return Scheduler(bm, max_batch_tokens=budget, speculation=DraftAlways(4)), bm


def decode_once(scheduler: Scheduler, s: Sequence) -> None:
    """Runs s's prompt (one step): it then decodes."""
    step = scheduler.schedule()
    scheduler.to_request(step, 1)
    scheduler.update(step, pb.StepResponse(generations=[pb.Generation(id=s.id, sampled=True, token_id=50)]))


def test_drafts_count_against_the_budget_and_get_blocks_and_go_out_as_draft_tokens():
    scheduler, bm = rig(budget=4)
    s = seq(1, [11, 12, 13], 20, eos=False)
    scheduler.add(s)
    decode_once(scheduler, s)
    step = scheduler.schedule()
    assert step.seqs == [(s, 4)] and step.drafts == {1: 3}  # 1 known token + 3 drafts = the budget
    assert len(s.block_table) * 4 >= s.num_computed + 4
    (running,) = scheduler.to_request(step, 2).running
    assert (running.num_scheduled_tokens, running.num_draft_tokens) == (1, 3)


def test_accepted_drafts_advance_the_sequence_and_an_eos_inside_the_run_ends_it_there():
    scheduler, bm = rig()
    s = seq(1, [11, 12, 13], 20)  # EOS: tokens 5..9
    scheduler.add(s)
    decode_once(scheduler, s)
    step = scheduler.schedule()
    gen = pb.Generation(id=1, sampled=True, token_id=30, next_tokens=[pb.NextToken(token_id=31)], num_drafted=4)
    assert scheduler.update(step, pb.StepResponse(generations=[gen])) == []
    assert s.generated_ids == [50, 30, 31] and s.num_computed == 5 and s.remaining == 1
    step = scheduler.schedule()
    gen = pb.Generation(id=1, sampled=True, token_id=32, num_drafted=4,
                        next_tokens=[pb.NextToken(token_id=t) for t in (33, 6, 34, 35)])
    assert scheduler.update(step, pb.StepResponse(generations=[gen])) == [s]
    assert s.generated_ids == [50, 30, 31, 32, 33, 6] and s.finish_reason is FinishReason.EOS_TOKEN
    assert bm.num_used == 0


def test_drafts_never_pass_max_new_tokens():
    scheduler, _ = rig()
    short = seq(1, [11, 12], 3, eos=False)
    roomy = seq(2, [40, 41], 20, eos=False)
    for s in (short, roomy):
        scheduler.add(s)
    step = scheduler.schedule()
    scheduler.update(step, pb.StepResponse(generations=[pb.Generation(id=i, sampled=True, token_id=50)
                                                        for i in (1, 2)]))
    step = scheduler.schedule()
    assert step.drafts == {1: 1, 2: 4}  # 1 generated, 1 to compute now, 1 draft: the third and last


def test_drafts_take_only_free_blocks_and_never_preempt():
    scheduler, bm = rig(num_blocks=2)
    s = seq(1, [11, 12, 13], 20, eos=False)
    other = seq(2, [21, 22, 23], 20, eos=False)
    scheduler.add(s)
    scheduler.add(other)
    step = scheduler.schedule()
    scheduler.update(step, pb.StepResponse(generations=[pb.Generation(id=i, sampled=True, token_id=50)
                                                        for i in (1, 2)]))
    step = scheduler.schedule()  # each holds 1 block of 4 with 4 tokens: no block left for drafts
    assert step.drafts == {} and scheduler.num_preemptions == 0 and [n for _, n in step.seqs] == [1, 1]


def test_a_step_ahead_leaves_room_for_every_draft_in_flight_being_accepted():
    scheduler, bm = rig()
    s = seq(1, [11, 12, 13], 20, eos=False)
    scheduler.add(s)
    decode_once(scheduler, s)
    inflight = scheduler.schedule()  # 1 + 4 drafts, computed 3 -> up to 8
    ahead = scheduler.schedule_ahead(inflight)
    assert ahead.seqs == [(s, 5)] and ahead.drafts == {1: 4}
    assert len(s.block_table) * 4 >= 3 + 5 + 5  # all accepted, then 1 + 4 more


class Seq:
    """A sequence as the policy sees it."""

    def __init__(self, i: int, accepted: float = 0.0, checked: float = 0.0):
        self.id, self.draft_accepted, self.draft_checked = i, accepted, checked
        self.steps_undrafted = 0


def feed(policy: SpeculationPolicy, tokens_and_seconds) -> None:
    """Decode-only steps of `tokens` sequences (no drafts) that took `seconds`."""
    for tokens, seconds in tokens_and_seconds:
        seqs = [Sequence(id=i, token_ids=[1, 2], params=pb.SamplingParameters(), stopping=StoppingCriteria(9),
                         prompt_length=1) for i in range(tokens)]
        policy.observe([(s, 1) for s in seqs], {}, {s.id: pb.Generation(id=s.id, sampled=True) for s in seqs},
                       seconds)


def test_policy_drafts_the_most_until_it_has_measured_a_step():
    policy = SpeculationPolicy(5)
    assert policy.drafts([Seq(1)], 64) == {1: 5}
    assert policy.rate(Seq(1)) == START_RATE


def test_policy_drafts_less_as_the_batch_grows():
    # CPU-like: a step costs 10 ms plus 1.5 ms a token
    policy = SpeculationPolicy(6)
    feed(policy, [(n, 0.010 + 0.0015 * n) for n in (1, 2, 8, 16, 32, 48, 64, 4)])
    seqs = [Seq(i, accepted=a, checked=c) for i, (a, c) in enumerate([(9, 10), (5, 10), (1, 10)], start=1)]
    alone, loaded = policy.drafts(seqs, 1), policy.drafts(seqs, 32)
    assert alone[1] == 6 and alone[2] >= 2 and alone.get(3, 0) <= 1
    # at 32: per token x B / step = 0.048 / 0.058 ~ 0.83: only a ~90% sequence drafts, once or twice
    assert set(loaded) <= {1} and loaded.get(1, 0) <= 2


def test_policy_learns_each_sequences_rate_from_its_drafts():
    policy = SpeculationPolicy(4)
    s = Sequence(id=1, token_ids=[1, 2, 3], params=pb.SamplingParameters(), stopping=StoppingCriteria(50),
                 prompt_length=2)
    for _ in range(5):  # 4 drafted, 1 accepted: 1 success, 1 failure each time
        gen = pb.Generation(id=1, sampled=True, token_id=3, next_tokens=[pb.NextToken(token_id=4)], num_drafted=4)
        policy.observe([(s, 5)], {1: 4}, {1: gen}, 0.01)
    assert policy.rate(s) == pytest.approx(0.5, abs=0.05)
    assert policy.acceptance_rate == pytest.approx(5 / 20)
    assert (policy.total_drafted, policy.total_accepted) == (20, 5)
    fresh = Seq(2)
    assert policy.rate(fresh) == pytest.approx((PRIOR * policy.rate(s)) / PRIOR, abs=0.05)


def checked(policy: SpeculationPolicy, seq: Sequence, drafted: int, accepted: int,
            seconds: float | None = None) -> None:
    """A decode-only step of seq alone, by default on a CPU-like line (6 ms + 0.5 ms a token)."""
    gen = pb.Generation(id=seq.id, sampled=True, token_id=3, num_drafted=drafted,
                        next_tokens=[pb.NextToken(token_id=4) for _ in range(accepted)])
    policy.observe([(seq, 1 + drafted)], {seq.id: drafted} if drafted else {}, {seq.id: gen},
                   0.006 + 0.0005 * (1 + drafted) if seconds is None else seconds)


def copier(i: int = 2) -> Sequence:
    return Sequence(id=i, token_ids=[1, 2, 3], params=pb.SamplingParameters(), stopping=StoppingCriteria(500),
                    prompt_length=2)


def serve(policy: SpeculationPolicy, seq: Sequence, host, steps: int) -> list[int]:
    """`steps` decode steps of seq alone as the scheduler runs them: the
    policy's drafts, as many as the proposer finds (7, 2, 5 or 0 in turn)
    and one of them rejected, the step taking host(rows) seconds; the
    drafts allowed in each."""
    allowed = []
    for i in range(steps):
        k = policy.drafts([seq], 1).get(seq.id, 0)
        drafted = min(k, (7, 2, 5, 0)[i % 4])
        checked(policy, seq, drafted, max(drafted - 1, 0), seconds=host(1 + drafted))
        allowed.append(k)
    return allowed


def test_a_hiccup_of_the_host_does_not_stop_drafting():
    policy, seq = SpeculationPolicy(7), copier()

    def cpu(rows: int) -> float:
        return 0.006 + 0.0005 * rows

    assert serve(policy, seq, cpu, 20)[-1] == 7
    serve(policy, seq, lambda rows: 0.6, 1)  # seen once: 1 + 7 rows in 0.6 s instead of 10 ms
    # had that tilted the line, the threshold would be 1: no draft again,
    # and one-token steps cannot tell the line's slope
    assert serve(policy, seq, cpu, 50)[-10:] == [7] * 10


def test_a_line_the_steps_no_longer_fit_is_measured_again():
    policy, seq = SpeculationPolicy(7), copier()
    serve(policy, seq, lambda rows: 0.003 + 0.007 * rows, 30)  # a token costs 7 ms: few drafts pay
    # The host got faster (a competitor left): the old slope leaves a
    # negative base; the policy drafts in full and measures the line again.
    assert serve(policy, seq, lambda rows: 0.006 + 0.0005 * rows, 200)[-10:] == [7] * 10
    base, per_token = policy.cost_line
    assert base == pytest.approx(0.006, rel=0.1) and per_token == pytest.approx(0.0005, rel=0.2)


def test_policy_probes_the_sequences_it_gives_no_drafts_so_that_rates_recover():
    policy = SpeculationPolicy(7)
    feed(policy, [(n, 0.006 + 0.0005 * n) for n in (1, 2, 4, 8, 1, 8, 4, 2)])
    writer = Sequence(id=1, token_ids=[1, 2, 3], params=pb.SamplingParameters(), stopping=StoppingCriteria(500),
                      prompt_length=2)
    for _ in range(60):  # a sequence writing text of its own: every draft rejected
        checked(policy, writer, 7, 0)
    copying = copier()
    assert policy.rate(copying) < 0.01  # the global rate, which a new sequence starts from
    # Alone (threshold 0.0005 / 0.0065 ~ 0.077) it is probed within 8 steps,
    # then drafts more as its drafts are accepted, up to all 7.
    allowed = []
    for _ in range(40):
        k = policy.drafts([copying], 1).get(2, 0)
        allowed.append(k)
        if k:
            checked(policy, copying, k, k)
    first = next(i for i, k in enumerate(allowed) if k)
    assert first < 8 and allowed[first] == 1
    assert allowed[-1] == 7 and allowed.index(7) < first + 15


def test_probes_under_load_cost_at_most_their_share_of_a_step():
    policy = SpeculationPolicy(7)
    feed(policy, [(n, 0.006 + 0.0005 * n) for n in (1, 2, 4, 8, 16, 32, 64, 32)])
    seqs = [Seq(i) for i in range(32)]  # rate 0.5: under load too low to draft
    probes = sum(len(policy.drafts(seqs, 32)) for _ in range(300))
    # a probe's row costs 0.5 ms; the 300 steps cost 22 ms each
    assert 0 < probes * 0.0005 <= PROBE_COST * 300 * (0.006 + 0.0005 * 32)


def test_a_step_ahead_drops_its_drafts_rather_than_the_step_when_blocks_are_short():
    scheduler, bm = rig(num_blocks=3)
    s = seq(1, [11, 12, 13], 20, eos=False)
    scheduler.add(s)
    decode_once(scheduler, s)  # 4 tokens: one block
    inflight = scheduler.schedule()  # 1 + 4 drafts: up to 8 tokens, two blocks
    assert inflight.drafts == {1: 4} and len(s.block_table) == 2
    ahead = scheduler.schedule_ahead(inflight)  # 4 more drafts would need a fourth block
    assert ahead is not None and ahead.seqs == [(s, 1)] and ahead.drafts == {}
