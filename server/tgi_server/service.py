"""The shard's servicer: translates calls (tgi_proto.rpc) into ModelRunner work.

Model calls run on the event loop's own thread, one at a time, as TGI's
shards do: handing them to a worker thread made decode steps slower, the
two threads contending for the GIL between torch ops
(figures: docs/tuning.md#model-calls-on-the-event-loop).
A call that arrives during a step waits for it. A Step sent before the
previous one's answer (async scheduling) names that step in after_step_id
and runs only once it has finished, whatever order the calls arrive in."""

import asyncio
import logging

import torch

from tgi_proto import pb
from tgi_proto.rpc import METHODS, RpcError, Server, StatusCode

from .model_runner import ModelRunner
from .sequences import StepError

log = logging.getLogger("tgi_server")


class TextGenerationService:
    def __init__(self, runner: ModelRunner, info: pb.InfoResponse):
        self.runner = runner
        self.info = info
        self._last_step_id = 0  # the step that finished last, failed or not
        self._step_done = asyncio.Condition()

    @staticmethod
    def _run(fn, *args):
        """fn(*args), with failures mapped to statuses carrying a one-line
        message (never a stack trace)."""
        try:
            return fn(*args)
        except StepError as err:
            raise RpcError(StatusCode.INVALID_ARGUMENT, str(err)) from err
        except (torch.OutOfMemoryError, MemoryError) as err:
            raise RpcError(StatusCode.RESOURCE_EXHAUSTED, f"out of memory: {err}") from err
        except Exception as err:  # the router needs a status, not a dropped call
            log.exception("model call failed")
            raise RpcError(StatusCode.INTERNAL, f"{type(err).__name__}: {err}") from err

    async def Info(self, request):
        info = pb.InfoResponse()
        info.CopyFrom(self.info)
        info.num_blocks = self.runner.cache.num_blocks
        info.warmed_up = self.runner.warmed_up
        return info

    async def Health(self, request):
        try:
            self.runner.health()
        except Exception as err:
            log.error("health check failed: %s: %s", type(err).__name__, err)
            raise RpcError(StatusCode.UNAVAILABLE, f"model cannot run a step: {err}") from err
        return pb.HealthResponse()

    async def Warmup(self, request):
        return self._run(self.runner.warmup, request)

    async def Step(self, request):
        if not self.runner.warmed_up:
            raise RpcError(StatusCode.FAILED_PRECONDITION, "Warmup has not run")
        if request.after_step_id and self._last_step_id != request.after_step_id:
            async with self._step_done:
                await self._step_done.wait_for(lambda: self._last_step_id == request.after_step_id)
        try:
            return self._run(self.runner.step, request)
        finally:
            async with self._step_done:
                self._last_step_id = request.step_id
                self._step_done.notify_all()

    async def Release(self, request):
        return pb.ReleaseResponse(released=self._run(self.runner.table.release, list(request.ids)))

    async def ClearCache(self, request):
        self._run(self.runner.table.clear)
        return pb.ClearCacheResponse()


async def serve(runner: ModelRunner, info: pb.InfoResponse, socket_path: str,
                ready: asyncio.Event | None = None) -> None:
    """Serves on unix://socket_path until cancelled or SIGTERM."""
    service = TextGenerationService(runner, info)
    server = Server({name: getattr(service, name) for name, _, _ in METHODS})
    await server.start(socket_path)
    log.info("shard %d ready on unix://%s", info.rank, socket_path)
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()
