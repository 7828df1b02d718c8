"""The router <-> shard transport (tgi_proto.rpc): answers matched to calls,
statuses carried, failures of the other side seen as statuses, never hangs."""

import asyncio
import contextlib
import struct

import pytest

from tgi_proto import pb
from tgi_proto.rpc import Channel, RpcError, Server, StatusCode


def serve(path, **handlers):
    server = Server(handlers)
    return server, server.start(str(path))


@contextlib.asynccontextmanager
async def served(path, **handlers):
    """A channel to a server of `handlers` on `path`, both closed after."""
    server, starting = serve(path, **handlers)
    await starting
    channel = Channel(str(path))
    try:
        yield channel
    finally:
        await channel.close()
        await server.stop()


def test_calls_on_one_connection_are_answered_in_any_order(tmp_path):
    async def scenario():
        release = asyncio.Event()

        async def step(request):
            await release.wait()
            return pb.StepResponse(generations=[pb.Generation(id=request.step_id)])

        async def health(request):
            return pb.HealthResponse()

        async with served(tmp_path / "s", Step=step, Health=health) as channel:
            slow = asyncio.ensure_future(channel.call("Step", pb.StepRequest(step_id=7)))
            await channel.call("Health", pb.HealthRequest())  # answered while the step waits
            assert not slow.done()
            release.set()
            assert (await slow).generations[0].id == 7
            answers = await asyncio.gather(*(channel.call("Step", pb.StepRequest(step_id=i)) for i in range(20)))
            assert [a.generations[0].id for a in answers] == list(range(20))

    asyncio.run(scenario())


def test_statuses_and_failures_reach_the_caller_and_the_server_goes_on(tmp_path):
    async def scenario():
        async def warmup(request):
            raise RpcError(StatusCode.RESOURCE_EXHAUSTED, "out of memory: 5 GiB")

        async def release(request):
            raise ValueError("a bug")

        async def info(request):
            return pb.InfoResponse(model_id="m", tokenizer_json="x" * (5 << 20))

        async with served(tmp_path / "s", Warmup=warmup, Release=release, Info=info) as channel:
            with pytest.raises(RpcError) as err:
                await channel.call("Warmup", pb.WarmupRequest())
            assert (err.value.code, err.value.details) == (StatusCode.RESOURCE_EXHAUSTED, "out of memory: 5 GiB")
            with pytest.raises(RpcError) as err:
                await channel.call("Release", pb.ReleaseRequest(ids=[1]))
            assert err.value.code is StatusCode.INTERNAL and err.value.details == "ValueError: a bug"
            with pytest.raises(RpcError) as err:
                await channel.call("Health", pb.HealthRequest())  # not served here
            assert err.value.code is StatusCode.UNKNOWN
            info = await channel.call("Info", pb.InfoRequest())  # 5 MiB, after all that
            assert info.model_id == "m" and len(info.tokenizer_json) == 5 << 20

    asyncio.run(scenario())


def test_a_frame_that_does_not_parse_is_invalid_argument(tmp_path):
    async def scenario():
        async def step(request):
            return pb.StepResponse()

        server, starting = serve(tmp_path / "s", Step=step)
        await starting
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "s"))
        try:
            payload = b"\xff\xff\xff"
            writer.write(struct.pack("<IIB", 5 + len(payload), 42, 3) + payload)  # method 3: Step
            size, call_id, status = struct.unpack("<IIB", await reader.readexactly(9))
            details = (await reader.readexactly(size - 5)).decode()
            assert (call_id, status) == (42, StatusCode.INVALID_ARGUMENT) and "StepRequest" in details
        finally:
            writer.close()
            await server.stop()

    asyncio.run(scenario())


def test_no_server_is_unavailable_and_a_restarted_one_is_reached_again(tmp_path):
    async def scenario():
        path = tmp_path / "s"
        channel = Channel(str(path))
        with pytest.raises(RpcError) as err:
            await channel.call("Health", pb.HealthRequest())
        assert err.value.code is StatusCode.UNAVAILABLE

        started = asyncio.Event()

        async def hang(request):
            started.set()
            await asyncio.sleep(3600)

        server, starting = serve(path, Step=hang)
        await starting
        pending = asyncio.ensure_future(channel.call("Step", pb.StepRequest()))
        await started.wait()
        await server.stop()  # the shard died mid-step
        with pytest.raises(RpcError) as err:
            await asyncio.wait_for(pending, 5)
        assert err.value.code is StatusCode.UNAVAILABLE

        async def health(request):
            return pb.HealthResponse()

        path.unlink()
        server, starting = serve(path, Health=health)
        await starting
        try:
            await channel.call("Health", pb.HealthRequest())
        finally:
            await channel.close()
            await server.stop()

    asyncio.run(scenario())


def test_a_call_past_its_timeout_is_deadline_exceeded_and_its_late_answer_is_dropped(tmp_path):
    async def scenario():
        async def step(request):
            await asyncio.sleep(0.3 if request.step_id == 1 else 0)
            return pb.StepResponse(generations=[pb.Generation(id=request.step_id)])

        async with served(tmp_path / "s", Step=step) as channel:
            with pytest.raises(RpcError) as err:
                await channel.call("Step", pb.StepRequest(step_id=1), timeout=0.05)
            assert err.value.code is StatusCode.DEADLINE_EXCEEDED
            await asyncio.sleep(0.4)  # the late answer arrives
            answer = await channel.call("Step", pb.StepRequest(step_id=2), timeout=5)
            assert answer.generations[0].id == 2

    asyncio.run(scenario())


def test_stopping_with_a_client_connected_logs_no_error(tmp_path, caplog):
    """stop() ends the connection tasks it cancels quietly: on Python 3.11
    asyncio's stream callback asks a cancelled task for its exception and
    logged a CancelledError traceback at every shard shutdown."""
    async def scenario():
        async def health(request):
            return pb.HealthResponse()

        server, starting = serve(tmp_path / "s", Health=health)
        await starting
        channel = Channel(str(tmp_path / "s"))
        await channel.call("Health", pb.HealthRequest())  # the connection is open and idle
        await server.stop()
        await asyncio.sleep(0.05)  # the stream callbacks run
        await channel.close()

    with caplog.at_level("DEBUG", logger="asyncio"):
        asyncio.run(scenario())
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
