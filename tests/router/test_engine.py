"""The engine's step loop with a fake shard client (no model)."""

import asyncio

from tgi_proto import pb
from tgi_router.block_manager import BlockManager
from tgi_router.engine import Engine
from tgi_router.scheduler import Scheduler
from tgi_router.sequence import FinishReason, Sequence, StoppingCriteria


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
