"""The router's side of the shard contract (tgi_proto.rpc over unix
sockets): one channel per shard, every call sent to all shards at once,
rank 0's answer returned. Imports no torch."""

import asyncio

from tgi_proto import pb
from tgi_proto.rpc import Channel, RpcError, StatusCode


class ShardError(RuntimeError):
    """A shard failed a call; `code` is its status (gRPC's codes)."""

    def __init__(self, rank: int, code: StatusCode, details: str):
        super().__init__(f"shard {rank}: {code.name}: {details}")
        self.rank, self.code, self.details = rank, code, details


class ShardClient:
    """Talks to shards listening on unix://{uds_path}-{rank}. `timeout`
    bounds every call; `step_timeout` bounds Step and Release (the step
    deadline: a shard that hangs mid-step, stopped or deadlocked, fails the
    call with DEADLINE_EXCEEDED instead of stalling the router forever)."""

    def __init__(self, socket_paths: list[str], timeout: float | None = None, step_timeout: float | None = None):
        self._channels = [Channel(p) for p in socket_paths]
        self.timeout = timeout
        self.step_timeout = step_timeout

    @classmethod
    def for_shards(cls, uds_path: str, world_size: int, timeout: float | None = None,
                   step_timeout: float | None = None) -> "ShardClient":
        return cls([f"{uds_path}-{rank}" for rank in range(world_size)], timeout, step_timeout)

    async def _all(self, method: str, request, timeout: float | None = None):
        """Calls every shard; raises the first failure as ShardError."""
        calls = [c.call(method, request, timeout or self.timeout) for c in self._channels]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for rank, result in enumerate(results):
            if isinstance(result, RpcError):
                raise ShardError(rank, result.code, result.details)
            if isinstance(result, BaseException):
                raise result
        return results[0]

    async def wait_ready(self, timeout: float) -> None:
        """Waits until every shard's socket accepts connections."""
        async def connected(channel: Channel) -> None:
            while True:
                try:
                    return await channel.connect()
                except RpcError:
                    await asyncio.sleep(0.05)
        await asyncio.wait_for(asyncio.gather(*(connected(c) for c in self._channels)), timeout)

    async def info(self) -> pb.InfoResponse:
        return await self._all("Info", pb.InfoRequest())

    async def health(self, timeout: float = 10.0) -> None:
        await self._all("Health", pb.HealthRequest(), timeout)

    async def warmup(self, max_batch_prefill_tokens: int, max_batch_size: int = 0,
                     kv_cache_bytes: int = 0) -> pb.WarmupResponse:
        return await self._all("Warmup", pb.WarmupRequest(
            max_batch_prefill_tokens=max_batch_prefill_tokens, max_batch_size=max_batch_size,
            kv_cache_bytes=kv_cache_bytes))

    async def step(self, request: pb.StepRequest) -> pb.StepResponse:
        return await self._all("Step", request, self.step_timeout)

    async def release(self, ids: list[int]) -> None:
        await self._all("Release", pb.ReleaseRequest(ids=ids), self.step_timeout)

    async def clear_cache(self) -> None:
        await self._all("ClearCache", pb.ClearCacheRequest())

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels))
