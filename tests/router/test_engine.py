"""The engine's step loop with a fake shard client (no model)."""

import asyncio
from types import SimpleNamespace
from unittest.mock import Mock

import pytest

from tgi_proto import pb
from tgi_proto.rpc import StatusCode
from tgi_router.errors import ValidationError
from tgi_router.scheduling import engine as engine_module
from tgi_router.scheduling.block_manager import BlockManager
from tgi_router.scheduling.client import ShardError
from tgi_router.scheduling.engine import Engine
from tgi_router.scheduling.scheduler import Scheduler
from tgi_router.scheduling.sequence import FinishReason, Sequence, Status, StoppingCriteria
from tgi_router.telemetry.metrics import Metrics
from tgi_router.web.admission import Gate, ServerState

from .fake_kv_shard import FakeKVShard


class FakeClient:
    """Samples token 7 for every sequence that reaches its last token; runs
    `on_release` while a release is in flight."""

    def __init__(self):
        self.on_release = None

    async def step(self, request: pb.StepRequest) -> pb.StepResponse:
        gens = [pb.Generation(id=n.id, sampled=n.num_scheduled_tokens + n.num_computed_tokens == len(n.token_ids),
                              token_id=7) for n in request.new_sequences]
        gens += [pb.Generation(id=r.id, sampled=True, token_id=7) for r in request.running]
        return pb.StepResponse(generations=gens)

    async def release(self, ids):
        if self.on_release:
            self.on_release()
            await asyncio.sleep(0)


def seq(i, n=3, new=1):
    return Sequence(id=i, token_ids=list(range(10, 10 + n)), params=pb.SamplingParameters(),
                    stopping=StoppingCriteria(new))


class FailingClient(FakeClient):
    """Fails its `fail_at`-th step (1-based) as a shard whose forward raised."""

    def __init__(self, fail_at: int):
        super().__init__()
        self.fail_at = fail_at
        self.steps = 0

    async def step(self, request: pb.StepRequest) -> pb.StepResponse:
        self.steps += 1
        if self.steps == self.fail_at:
            raise ShardError(0, StatusCode.INTERNAL, "forward failed")
        return await super().step(request)


def samples(metrics: Metrics) -> dict[str, float]:
    """Series (name with its labels) -> value, from the exposition."""
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.render().decode().splitlines()
            if not line.startswith("#")}


def test_a_request_arriving_during_a_release_is_not_failed():
    async def go():
        client = FakeClient()
        scheduler = Scheduler(BlockManager(8, 4), max_batch_tokens=64)
        engine = Engine(client, scheduler)
        scheduler.add(seq(1))
        await engine.step()  # seq 1 finishes; its release goes out with the next step
        late = seq(2)
        client.on_release = lambda: scheduler.add(late)
        await engine.step()  # nothing to run, only the release: seq 2 arrives meanwhile
        assert late.finish_reason is None
        await engine.step()
        assert late.finish_reason is FinishReason.LENGTH
    asyncio.run(go())


def test_a_cancelled_request_ends_its_unfinished_sequences_as_cancelled_not_length():
    """Cancelling (the client hung up, or the request failed) is no length
    limit: the unfinished sequences end as CANCELLED and give their blocks
    back; one that had finished keeps its reason."""
    async def go():
        bm = BlockManager(8, 4)
        scheduler = Scheduler(bm, max_batch_tokens=64, max_batch_size=2)
        engine = Engine(FakeClient(), scheduler, plan_ahead=False)
        done, running, waiting = seq(1, new=1), seq(2, new=5), seq(3, new=5)
        for s in (done, running, waiting):
            scheduler.add(s)
        await engine.step()
        assert (done.status, running.status, waiting.status) == (Status.FINISHED, Status.RUNNING, Status.WAITING)
        engine.cancel(SimpleNamespace(sequences=[done, running, waiting]))
        while not engine.idle:
            await engine.step()
        return bm, [s.finish_reason for s in (done, running, waiting)]
    bm, reasons = asyncio.run(go())
    assert reasons == [FinishReason.LENGTH, FinishReason.CANCELLED, FinishReason.CANCELLED]
    assert bm.num_used == 0


class KVClient:
    """The fake KV shard behind the client's async interface."""

    def __init__(self, shard: FakeKVShard):
        self.shard = shard

    async def step(self, request: pb.StepRequest) -> pb.StepResponse:
        return self.shard.step(request)

    async def release(self, ids):
        self.shard.step(pb.StepRequest(release_ids=ids))


def test_engine_reports_prefix_cache_blocks_and_chunks():
    async def go():
        bm = BlockManager(16, 4)
        scheduler = Scheduler(bm, max_batch_tokens=4)
        metrics = Metrics(100, 200)
        engine = Engine(KVClient(FakeKVShard(bm)), scheduler, metrics=metrics)
        scheduler.add(seq(1, n=10))  # 3 chunks of at most 4 tokens
        while not engine.idle:
            await engine.step()
        scheduler.add(seq(2, n=10))  # the same prompt: 8 tokens hit
        while not engine.idle:
            await engine.step()
        return samples(metrics)
    m = asyncio.run(go())
    assert m["tgi_prefix_cache_queried_tokens"] == 20 and m["tgi_prefix_cache_hit_tokens"] == 8
    assert m["tgi_request_prefill_chunks_count"] == 2 and m["tgi_request_prefill_chunks_sum"] == 3 + 1
    assert m["tgi_kv_cache_blocks_used"] == 0 and m["tgi_kv_cache_blocks_free"] == 16
    assert m["tgi_kv_cache_blocks_cached"] == 2


def idle_engine() -> Engine:
    return Engine(FakeClient(), Scheduler(BlockManager(8, 4), max_batch_tokens=64))


def frozen_clock(monkeypatch) -> list[float]:
    """The engine's clock, stopped at 0 until the test moves it ([0] = now)."""
    now = [0.0]
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    return now


def test_an_idle_engine_with_nothing_being_validated_does_not_wait():
    """A lone request: gather returns without yielding to the event loop once."""
    gather = idle_engine().gather()
    with pytest.raises(StopIteration):
        gather.send(None)


def test_an_idle_engine_waits_for_requests_still_being_validated(monkeypatch):
    """A burst's first step takes the requests validated alongside the one
    that woke the engine: gather ends when the last validation does (the
    clock stands still, so only that can end it)."""
    frozen_clock(monkeypatch)

    async def go():
        engine = idle_engine()
        engine.validating = 1
        waiting = asyncio.create_task(engine.gather())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiting.done()
        engine.validating = 0
        await asyncio.wait_for(waiting, 30)  # only stops a hang
    asyncio.run(go())


def test_an_idle_engine_waits_for_a_slow_validation_at_most_gather_s(monkeypatch):
    now = frozen_clock(monkeypatch)

    async def go():
        engine = idle_engine()
        engine.validating = 1  # a validation that takes long
        waiting = asyncio.create_task(engine.gather())
        await asyncio.sleep(0)  # gather starts: its deadline is GATHER_S from now
        now[0] = engine_module.GATHER_S * 0.99
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiting.done()
        now[0] = engine_module.GATHER_S
        await asyncio.wait_for(waiting, 30)  # only stops a hang
        assert engine.validating == 1
    asyncio.run(go())


@pytest.mark.parametrize("fail_at, method", [(1, "prefill"), (2, "decode")])
def test_a_failed_forward_counts_as_a_batch_inference_failure_of_its_method(fail_at, method):
    """tgi_batch_inference_failure{method}: the step that computes the
    prompt is a prefill, the next one (the prompt computed) a decode."""
    async def go():
        metrics = Metrics(100, 200)
        engine = Engine(FailingClient(fail_at), Scheduler(BlockManager(8, 4), max_batch_tokens=64), metrics=metrics)
        engine.scheduler.add(seq(1, new=5))
        await asyncio.wait_for(engine.run_forever(), 30)  # returns once a step fails; the timeout stops a hang
        return engine, samples(metrics)
    engine, m = asyncio.run(go())
    other = "decode" if method == "prefill" else "prefill"
    assert m[f'tgi_batch_inference_failure{{method="{method}"}}'] == 1
    assert m[f'tgi_batch_inference_failure{{method="{other}"}}'] == 0
    assert m[f'tgi_batch_inference_count{{method="{method}"}}'] == 1
    assert m[f'tgi_batch_inference_success{{method="{method}"}}'] == 0
    assert not engine.healthy


def test_the_filter_duration_is_the_time_spent_applying_a_steps_answer(monkeypatch):
    """tgi_batch_filter_duration: Scheduler.update, which appends a step's
    tokens and drops the sequences that finished; a part of the step's
    inference duration. Only update moves the clock here."""
    now = frozen_clock(monkeypatch)
    scheduler = Scheduler(BlockManager(8, 4), max_batch_tokens=64)
    update = scheduler.update

    def update_taking_half_a_second(step, response):
        now[0] += 0.5
        return update(step, response)
    scheduler.update = update_taking_half_a_second
    metrics = Metrics(100, 200)
    engine = Engine(FakeClient(), scheduler, metrics=metrics)

    async def go():
        scheduler.add(seq(1, new=2))  # one prefill step, one decode step
        while not engine.idle:
            await engine.step()
    asyncio.run(go())
    m = samples(metrics)
    for method in ("prefill", "decode"):
        assert m[f'tgi_batch_filter_duration_count{{method="{method}"}}'] == 1
        assert m[f'tgi_batch_filter_duration_sum{{method="{method}"}}'] == 0.5
        assert m[f'tgi_batch_inference_duration_sum{{method="{method}"}}'] >= 0.5


def test_the_routes_count_requests_being_validated_whatever_the_outcome():
    engine = Engine(FakeClient(), Scheduler(BlockManager(8, 4), max_batch_tokens=64))
    gate = Gate(engine, SimpleNamespace(max_concurrent_requests=4), Mock(), ServerState())
    seen = []

    def prepare():
        seen.append(engine.validating)
        return []

    def invalid():
        seen.append(engine.validating)
        raise ValidationError("bad input")

    async def go():
        await gate.admit(prepare)
        with pytest.raises(ValidationError):
            await gate.admit(invalid)
    asyncio.run(go())
    assert seen == [1, 1] and engine.validating == 0
