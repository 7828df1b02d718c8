"""Async scheduling: the engine sends step N+1 before step N's answer. A fake
shard that checks every K/V a sequence reads (tests/router/fake_kv_shard.py)
runs the steps in order, as a real shard does; outputs must equal each
sequence run alone, and no block or shard-side sequence may leak."""

import asyncio
import random

import pytest

from tgi_proto import pb
from tgi_router.scheduling.block_manager import BlockManager
from tgi_router.scheduling.engine import Engine
from tgi_router.scheduling.scheduler import Scheduler
from tgi_router.scheduling.sequence import FinishReason, Sequence, Status, StoppingCriteria

from .fake_kv_shard import FakeKVShard, next_token
from .test_step_pacer import FixedCap

EOS = frozenset(range(5, 10))  # stop tokens: about one token in ten of the fake's


def seq(i: int, prompt: list[int], max_new: int, eos: bool = True) -> Sequence:
    stop = EOS if eos else frozenset()
    return Sequence(id=i, token_ids=list(prompt), params=pb.SamplingParameters(),
                    stopping=StoppingCriteria(max_new, stop))


def alone(prompt: list[int], max_new: int, eos: bool = True) -> list[int]:
    """What the fake shard generates for one sequence by itself."""
    tokens, out = list(prompt), []
    while len(out) < max_new:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if eos and t in EOS:
            break
    return out


class Client:
    """The fake shard behind the client's async interface; records requests."""

    def __init__(self, shard: FakeKVShard):
        self.shard = shard
        self.requests: list[pb.StepRequest] = []
        self.busy = asyncio.Lock()  # first come, first served: one step at a time, in order

    async def step(self, request: pb.StepRequest) -> pb.StepResponse:
        self.requests.append(request)
        async with self.busy:
            response = self.shard.step(request)
            for _ in range(5):  # the engine runs on while the step "computes"
                await asyncio.sleep(0)
        response.timings.total_ns = 10 ** 9  # a step far slower than the router: planning ahead pays
        return response

    async def release(self, ids):
        self.shard.step(pb.StepRequest(release_ids=ids))


SCENARIOS = {
    "roomy": dict(num_blocks=256, budget=64, caching=True),
    "chunked prompts": dict(num_blocks=256, budget=7, caching=True),
    "preempting": dict(num_blocks=14, budget=64, caching=True),
    "no prefix cache": dict(num_blocks=40, budget=16, caching=False),
    # prompt tokens beside decodes capped at 3 a step; joins cut short go on
    "paced": dict(num_blocks=256, budget=64, caching=True, cap=3),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_pipelined_outputs_equal_each_sequence_alone_and_nothing_leaks(scenario):
    cfg = SCENARIOS[scenario]
    rng = random.Random(scenario)
    shared = [rng.randrange(10, 60) for _ in range(9)]  # a common prefix for some prompts

    async def go():
        bm = BlockManager(cfg["num_blocks"], 4, cfg["caching"])
        scheduler = Scheduler(bm, max_batch_tokens=cfg["budget"],
                              pacer=FixedCap(cfg["cap"]) if "cap" in cfg else None)
        shard = FakeKVShard(bm)
        client = Client(shard)
        engine = Engine(client, scheduler)
        seqs, cancelled = [], set()
        for _ in range(400):
            if len(seqs) < 24 and rng.random() < 0.3:
                prefix = shared[:rng.randrange(0, 10)] if rng.random() < 0.5 else []
                prompt = prefix + [rng.randrange(10, 60) for _ in range(rng.randrange(1, 12))]
                s = seq(len(seqs) + 1, prompt, rng.randrange(1, 20), eos=rng.random() < 0.7)
                s.prompt = list(prompt)
                seqs.append(s)
                scheduler.add(s)
            live = [s for s in seqs if s.status is Status.RUNNING]
            if live and rng.random() < 0.03:  # a client goes away mid-flight
                victim = rng.choice(live)
                scheduler.finish(victim, FinishReason.CANCELLED)
                cancelled.add(victim.id)
            await engine.step()
            if len(seqs) >= 24 and engine.idle:
                break
        while not engine.idle:
            await engine.step()
        return bm, shard, client, seqs, cancelled, scheduler.num_preemptions

    bm, shard, client, seqs, cancelled, preemptions = asyncio.run(go())
    assert len(seqs) == 24 and all(s.status is Status.FINISHED for s in seqs)
    for s in seqs:
        expected = alone(s.prompt, s.stopping.max_new_tokens, bool(s.stopping.stop_token_ids))
        if s.id in cancelled:
            assert s.generated_ids == expected[:len(s.generated_ids)]
        else:
            assert s.generated_ids == expected, s.id
    assert bm.num_used == 0 and not shard.seqs  # every block freed, every sequence released
    assert sum(bool(r.after_step_id) for r in client.requests) > len(client.requests) // 2  # pipelined
    assert any(s.finish_reason is FinishReason.EOS_TOKEN for s in seqs)
    assert (preemptions > 0) == (scenario == "preempting")


def test_the_next_step_goes_out_before_the_answer_and_names_its_predecessor():
    gate = asyncio.Event

    class HeldClient:
        def __init__(self):
            self.requests, self.answered = [], None

        async def step(self, request):
            self.requests.append(request)
            await self.answered.wait()
            return pb.StepResponse(generations=[
                pb.Generation(id=n.id, sampled=True, token_id=7, num_computed_tokens=len(n.token_ids))
                for n in request.new_sequences] + [
                pb.Generation(id=r.id, sampled=True, token_id=7) for r in request.running])

    async def go():
        client = HeldClient()
        client.answered = gate()
        scheduler = Scheduler(BlockManager(16, 4), max_batch_tokens=64)
        engine = Engine(client, scheduler)
        scheduler.add(seq(1, [10, 11, 12], max_new=3, eos=False))
        task = asyncio.ensure_future(engine.step())
        for _ in range(3):
            await asyncio.sleep(0)
        first, second = client.requests
        assert second.after_step_id == first.step_id and not second.new_sequences
        (r,) = second.running
        assert r.id == 1 and r.num_scheduled_tokens == 1  # the token step 1 samples, unknown yet
        client.answered.set()
        await task
        return scheduler

    asyncio.run(go())


def rig(num_blocks: int = 16, budget: int = 64) -> tuple[Scheduler, FakeKVShard]:
    bm = BlockManager(num_blocks, 4)
    return Scheduler(bm, max_batch_tokens=budget), FakeKVShard(bm)


def test_a_sequence_whose_token_in_flight_is_its_last_is_not_scheduled_ahead():
    s, _ = rig()
    last, more = seq(1, [10, 11, 12], max_new=1), seq(2, [20, 21, 22], max_new=2)
    s.add(last)
    s.add(more)
    step = s.schedule()
    s.to_request(step, 1)
    ahead = s.schedule_ahead(step)
    assert [(q.id, n) for q, n in ahead.seqs] == [(2, 1)]


def test_a_chunked_prompt_continues_ahead_from_where_the_step_in_flight_leaves_it():
    s, shard = rig(budget=4)
    a = seq(1, list(range(10, 20)), max_new=2)
    s.add(a)
    step = s.schedule()
    request = s.to_request(step, 1)
    ahead = s.schedule_ahead(step)
    assert [(q.id, n) for q, n in ahead.seqs] == [(1, 4)] and a.num_computed == 0  # tokens 4..7
    second = s.to_request(ahead, 2, after_step_id=1)
    s.update(step, shard.step(request))
    s.update(ahead, shard.step(second))
    assert a.num_computed == 8 and a.num_generated == 0


def test_schedule_ahead_never_preempts_and_takes_nothing_when_blocks_are_short():
    s, _ = rig(num_blocks=2)
    a, b = seq(1, [10, 11, 12, 13], max_new=8), seq(2, [20, 21, 22, 23], max_new=8)
    s.add(a)
    s.add(b)
    step = s.schedule()  # one block each; their next tokens need a second block each
    s.to_request(step, 1)
    assert s.schedule_ahead(step) is None
    assert s.blocks.num_used == 2 and a.status is b.status is Status.RUNNING


def test_a_sequence_ended_in_flight_is_released_by_a_later_step():
    s, shard = rig()
    a = seq(1, [10, 11, 12], max_new=10, eos=False)
    s.add(a)
    step = s.schedule()
    first = s.to_request(step, 1)
    ahead = s.schedule_ahead(step)
    second = s.to_request(ahead, 2, after_step_id=1)
    s.update(step, shard.step(first))
    s.finish(a, FinishReason.STOP_SEQUENCE)  # a stop string seen in step 1's text
    s.update(ahead, shard.step(second))  # its extra token, computed and dropped
    assert a.num_generated == 1 and s.blocks.num_used == 0
    assert s.schedule().release_ids == [1]


def one_sequence_through(client_class: type[Client], max_new: int) -> list[pb.StepRequest]:
    """The requests an engine sends to client_class(a fake shard) for one
    3-token prompt and max_new tokens, stepped as run_forever steps it."""
    async def go():
        bm = BlockManager(64, 4)
        scheduler = Scheduler(bm, max_batch_tokens=64)
        client = client_class(FakeKVShard(bm))
        engine = Engine(client, scheduler)
        scheduler.add(seq(1, [10, 11, 12], max_new=max_new, eos=False))
        while not engine.idle:
            await engine.step()
            await asyncio.sleep(0)  # as run_forever does between steps
        return client.requests

    return asyncio.run(go())


def test_an_answer_already_back_is_applied_before_the_next_step_is_planned():
    """Planning ahead pays only while the shards compute. With answers that
    are back at once, only a step just sent (whose answer cannot be back yet)
    has the next one planned ahead of it: never two in a row."""
    class Instant(Client):
        async def step(self, request):
            self.requests.append(request)
            response = self.shard.step(request)
            response.timings.total_ns = 10 ** 9  # the shard claims to set the pace: done() alone decides
            return response

    requests = one_sequence_through(Instant, max_new=6)
    ahead = [bool(r.after_step_id) for r in requests]
    assert len(requests) == 6 and not any(a and b for a, b in zip(ahead, ahead[1:]))


def test_no_step_is_planned_ahead_while_the_router_sets_the_pace():
    """A shard step far shorter than the time between answers (a tiny model,
    a busy router): steps go out one at a time, as before async scheduling."""
    class Quick(Client):
        async def step(self, request):
            self.requests.append(request)
            async with self.busy:  # one step at a time, in order, as a shard
                response = self.shard.step(request)
                await asyncio.sleep(0.002)  # the round trip
            response.timings.total_ns = 10_000  # 10 us of it on the shard
            return response

    requests = one_sequence_through(Quick, max_new=8)
    assert len(requests) == 8 and sum(bool(r.after_step_id) for r in requests) <= 1  # the first, before any answer
