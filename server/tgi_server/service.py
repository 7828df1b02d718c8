"""The gRPC servicer: translates calls into ModelRunner work on one worker
thread, so the event loop stays free (Health answers during a long step)
and model calls never overlap."""

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

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
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._busy = asyncio.Lock()

    async def _call(self, fn, *args):
        """Runs fn on the model thread, one call at a time."""
        async with self._busy:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _run(self, context: grpc.aio.ServicerContext, fn, *args):
        """_call, with failures mapped to gRPC statuses carrying a one-line
        message (never a stack trace)."""
        try:
            return await self._call(fn, *args)
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
        if self._busy.locked():
            return pb.HealthResponse()  # a step is running: the model works
        try:
            await self._call(self.runner.health)
        except Exception as err:
            log.error("health check failed: %s: %s", type(err).__name__, err)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"model cannot run a step: {err}")
        return pb.HealthResponse()

    async def Warmup(self, request, context):
        return await self._run(context, self.runner.warmup, request)

    async def Step(self, request, context):
        if not self.runner.warmed_up:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Warmup has not run")
        return await self._run(context, self.runner.step, request)

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
