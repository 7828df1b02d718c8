"""The router's side of the gRPC contract: one channel per shard, every call
sent to all shards at once, rank 0's answer returned. Imports no torch."""

import asyncio

import grpc

from tgi_proto import pb, pb_grpc

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.max_send_message_length", 256 << 20),
]


class ShardError(RuntimeError):
    """A shard failed a call; `code` is the gRPC status code."""

    def __init__(self, rank: int, code: grpc.StatusCode, details: str):
        super().__init__(f"shard {rank}: {code.name}: {details}")
        self.rank, self.code, self.details = rank, code, details


class ShardClient:
    """Talks to shards listening on unix://{uds_path}-{rank}. `timeout`
    bounds every call; `step_timeout` bounds Step and Release (the step
    deadline: a shard that hangs mid-step, stopped or deadlocked, fails the
    call with DEADLINE_EXCEEDED instead of stalling the router forever)."""

    def __init__(self, socket_paths: list[str], timeout: float | None = None, step_timeout: float | None = None):
        self._channels = [grpc.aio.insecure_channel(f"unix://{p}", options=GRPC_OPTIONS) for p in socket_paths]
        self._stubs = [pb_grpc.TextGenerationServiceStub(c) for c in self._channels]
        self.timeout = timeout
        self.step_timeout = step_timeout

    @classmethod
    def for_shards(cls, uds_path: str, world_size: int, timeout: float | None = None,
                   step_timeout: float | None = None) -> "ShardClient":
        return cls([f"{uds_path}-{rank}" for rank in range(world_size)], timeout, step_timeout)

    async def _all(self, method: str, request, timeout: float | None = None):
        """Calls every shard; raises the first failure as ShardError."""
        calls = [getattr(stub, method)(request, timeout=timeout or self.timeout) for stub in self._stubs]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for rank, result in enumerate(results):
            if isinstance(result, grpc.aio.AioRpcError):
                raise ShardError(rank, result.code(), result.details() or "")
            if isinstance(result, BaseException):
                raise result
        return results[0]

    async def wait_ready(self, timeout: float) -> None:
        """Waits until every shard's socket accepts connections."""
        await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in self._channels)), timeout)

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
