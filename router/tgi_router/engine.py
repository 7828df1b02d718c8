"""The step loop: schedule, run on the shards, apply the results."""

from .client import ShardClient
from .scheduler import Scheduler
from .sequence import Sequence


class Engine:
    def __init__(self, client: ShardClient, scheduler: Scheduler):
        self.client = client
        self.scheduler = scheduler
        self.step_id = 0

    async def step(self) -> list[Sequence]:
        """One forward on the shards; returns the sequences that finished."""
        step = self.scheduler.schedule()
        if not step.seqs:
            if step.release_ids:
                await self.client.release(step.release_ids)
            if self.scheduler.has_work():
                raise RuntimeError("no sequence fits in the KV cache")
            return []
        self.step_id += 1
        response = await self.client.step(self.scheduler.to_request(step, self.step_id))
        return self.scheduler.update(step, response)

    async def run_until_idle(self) -> None:
        while self.scheduler.has_work():
            await self.step()
