"""The gRPC servicer: translates calls into ModelRunner work.

Model calls run on the event loop's own thread, one at a time, as TGI's
shards do: handing them to a worker thread measured ~15% slower per decode
step on 2 cores (the two threads contend for the GIL between torch ops).
A call that arrives during a step waits for it. A Step sent before the
previous one's answer (async scheduling) names that step in after_step_id
and runs only once it has finished, whatever order the calls arrive in."""

import asyncio
import logging

import grpc
import torch

from tgi_proto import pb, pb_grpc

from .model_runner import ModelRunner
from .sequences import StepError

log = logging.getLogger("tgi_server")


class TextGenerationService(pb_grpc.TextGenerationServiceServicer):
    def __init__(self, runner: ModelRunner, info: pb.InfoResponse):
        self.runner = runner
        self.info = info
        self._last_step_id = 0  # the step that finished last, failed or not
        self._step_done = asyncio.Condition()

    async def _run(self, context: grpc.aio.ServicerContext, fn, *args):
        """fn(*args), with failures mapped to gRPC statuses carrying a
        one-line message (never a stack trace)."""
        try:
            return fn(*args)
        except StepError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except (torch.OutOfMemoryError, MemoryError) as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of memory: {err}")
        except Exception as err:  # the router needs a status, not a dropped call
            log.exception("model call failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")

    async def Info(self, request, context):
        info = pb.InfoResponse()
        info.CopyFrom(self.info)
        info.num_blocks = self.runner.cache.num_blocks
        info.warmed_up = self.runner.warmed_up
        return info

    async def Health(self, request, context):
        try:
            self.runner.health()
        except Exception as err:
            log.error("health check failed: %s: %s", type(err).__name__, err)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"model cannot run a step: {err}")
        return pb.HealthResponse()

    async def Warmup(self, request, context):
        return await self._run(context, self.runner.warmup, request)

    async def Step(self, request, context):
        if not self.runner.warmed_up:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Warmup has not run")
        if request.after_step_id and self._last_step_id != request.after_step_id:
            async with self._step_done:
                await self._step_done.wait_for(lambda: self._last_step_id == request.after_step_id)
        try:
            return await self._run(context, self.runner.step, request)
        finally:
            async with self._step_done:
                self._last_step_id = request.step_id
                self._step_done.notify_all()

    async def Release(self, request, context):
        released = await self._run(context, self.runner.table.release, list(request.ids))
        return pb.ReleaseResponse(released=released)

    async def ClearCache(self, request, context):
        await self._run(context, self.runner.table.clear)
        return pb.ClearCacheResponse()


async def serve(runner: ModelRunner, info: pb.InfoResponse, socket_path: str,
                ready: asyncio.Event | None = None) -> None:
    """Serves on unix://socket_path until cancelled or SIGTERM."""
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", 256 << 20),
        ("grpc.max_send_message_length", 256 << 20),
    ])
    pb_grpc.add_TextGenerationServiceServicer_to_server(TextGenerationService(runner, info), server)
    server.add_insecure_port(f"unix://{socket_path}")
    await server.start()
    log.info("shard %d ready on unix://%s", info.rank, socket_path)
    if ready is not None:
        ready.set()
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(grace=1)
