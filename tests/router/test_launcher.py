"""The launcher's orchestration with stand-in shards (tiny Python processes),
a stand-in readiness wait and a stand-in router: start-up failures, SIGTERM,
a shard dying while serving, stopping stubborn shards, --flash-attention, the
shard command line, and log lines."""

import asyncio
import json
import logging
import os
import signal
import sys
import time
from types import SimpleNamespace

import pytest

from tgi_proto import pb
from tgi_proto.rpc import RpcError, Server, StatusCode
from tgi_router.launch import launcher
from tgi_router.launch.config import ConfigError, RouterConfig, parse_args
from tgi_router.launch.shard_processes import shard_command, shard_env, wait_for_shards

FAKE_SHARD = r"""
import os, signal, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
mode = sys.argv[2]
print("2026-01-01 00:00:00,000 INFO tgi_server: loading model", flush=True)
if mode == "fail":
    print("error: no model at /nope", file=sys.stderr, flush=True)
    sys.exit(1)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
while True:
    time.sleep(0.05)
"""
CPU_INFO = SimpleNamespace(model_id="fake", dtype="float32", device="cpu", attention_backend="sdpa")


@pytest.fixture
def config(tmp_path):
    return RouterConfig(shard_uds_path=str(tmp_path / "shard"), graceful_termination_timeout=2)


def fake_shards(tmp_path, mode="serve"):
    return lambda config, rank: [sys.executable, "-c", FAKE_SHARD, str(tmp_path / f"pid-{rank}"), mode]


async def ready_at_once(config):
    return CPU_INFO


async def never_ready(config):
    await asyncio.Event().wait()


def pid_of(tmp_path, rank=0) -> int:
    """The stand-in shard's pid, once it has started."""
    path, deadline = tmp_path / f"pid-{rank}", time.monotonic() + 10
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, "the stand-in shard never started"
        time.sleep(0.01)
    return int(path.read_text())


def is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def run(config, tmp_path, mode="serve", ready=ready_at_once, serve=None) -> int:
    return asyncio.run(launcher.launch(config, os.environ, command=fake_shards(tmp_path, mode),
                                       ready=ready, serve=serve))


def test_shard_exiting_during_start_up_exits_1_with_its_stderr_line(config, tmp_path, capsys):
    assert run(config, tmp_path, "fail", ready=never_ready) == 1
    err = capsys.readouterr().err
    assert err == "error: shard 0 exited with code 1 during start-up: error: no model at /nope\n"


def test_missing_shard_program_exits_1(config, tmp_path, capsys):
    code = asyncio.run(launcher.launch(config, os.environ, command=lambda c, r: [str(tmp_path / "nope")],
                                       ready=never_ready, serve=None))
    assert code == 1 and "could not start" in capsys.readouterr().err


def test_sigterm_sets_shutdown_then_shards_are_terminated(config, tmp_path):
    seen = {}

    async def router(config, shard_failed, shutdown):
        pid_of(tmp_path)
        os.kill(os.getpid(), signal.SIGTERM)
        await shutdown.wait()
        seen["shard_failed"] = shard_failed.is_set()
        return 0

    assert run(config, tmp_path, serve=router) == 0
    assert seen == {"shard_failed": False}
    assert is_gone(pid_of(tmp_path))


def test_repeated_sigterm_keeps_draining_but_a_second_sigint_stops_at_once(config, tmp_path):
    async def router(config, shard_failed, shutdown, sig=signal.SIGTERM):
        pid_of(tmp_path)
        os.kill(os.getpid(), sig)
        await shutdown.wait()
        os.kill(os.getpid(), sig)
        await asyncio.sleep(0.3)  # still draining
        return 0

    assert run(config, tmp_path, serve=router) == 0
    assert run(config, tmp_path, serve=lambda c, f, s: router(c, f, s, signal.SIGINT)) == 1


def test_sigterm_during_start_up_exits_0_and_stops_shards(config, tmp_path):
    async def ready(config):
        pid_of(tmp_path)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.Event().wait()

    assert run(config, tmp_path, ready=ready) == 0
    assert is_gone(pid_of(tmp_path))


def test_shard_dying_while_serving_sets_shard_failed_and_exits_non_zero(config, tmp_path, capsys):
    async def router(config, shard_failed, shutdown):
        os.kill(pid_of(tmp_path), signal.SIGKILL)
        await asyncio.wait_for(shard_failed.wait(), 5)
        return 0  # the router failed its requests and returned by itself

    assert run(config, tmp_path, serve=router) == 1
    assert "error: shard 0 was killed by signal 9 while serving" in capsys.readouterr().err


def test_router_still_serving_after_a_shard_died_is_told_to_shut_down(config, tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "SHARD_FAILURE_GRACE_S", 0.2)
    seen = {}

    async def router(config, shard_failed, shutdown):
        os.kill(pid_of(tmp_path), signal.SIGKILL)
        await asyncio.wait_for(shutdown.wait(), 5)  # /health answered 503 meanwhile
        seen["shard_failed"] = shard_failed.is_set()
        return 0

    assert run(config, tmp_path, serve=router) == 1
    assert seen == {"shard_failed": True}


def test_router_that_does_not_drain_in_time_is_cancelled(config, tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "DRAIN_MARGIN_S", 0.0)
    config = RouterConfig(shard_uds_path=config.shard_uds_path, graceful_termination_timeout=0)

    async def router(config, shard_failed, shutdown):
        shutdown.set()
        await asyncio.Event().wait()

    assert run(config, tmp_path, serve=router) == 1


def test_shard_ignoring_sigterm_is_killed(config, tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "SHARD_STOP_TIMEOUT_S", 0.3)

    async def router(config, shard_failed, shutdown):
        pid_of(tmp_path)
        await asyncio.sleep(0.2)  # the shard ignores SIGTERM from here on
        return 0

    started = time.monotonic()
    assert run(config, tmp_path, "stubborn", serve=router) == 0
    assert is_gone(pid_of(tmp_path)) and time.monotonic() - started < 10


def test_router_code_is_the_exit_code(config, tmp_path):
    async def router(config, shard_failed, shutdown):
        return 3

    assert run(config, tmp_path, serve=router) == 3


def test_router_config_error_exits_2_with_one_line(config, tmp_path, capsys):
    async def router(config, shard_failed, shutdown):
        raise ConfigError("Not enough memory to handle `max_total_tokens=9000`")

    assert run(config, tmp_path, serve=router) == 2
    assert capsys.readouterr().err == "error: Not enough memory to handle `max_total_tokens=9000`\n"


def test_flash_attention_refused_without_a_flash_style_backend(tmp_path, capsys):
    config = RouterConfig(shard_uds_path=str(tmp_path / "shard"), flash_attention=True)

    async def cuda_without_flash_attn(config):
        return SimpleNamespace(model_id="m", dtype="float16", device="cuda:0", attention_backend="sdpa")

    assert run(config, tmp_path, ready=cuda_without_flash_attn) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--flash-attention" in err and "flash-attn" in err


def test_flash_attention_accepted_on_cpu_with_fused_sdpa(tmp_path):
    config = RouterConfig(shard_uds_path=str(tmp_path / "shard"), flash_attention=True)

    async def router(config, shard_failed, shutdown):
        return 0

    assert run(config, tmp_path, serve=router) == 0
    assert launcher.flash_attention_problem(SimpleNamespace(device="cuda:0", attention_backend="flash_attn")) is None
    assert launcher.flash_attention_problem(SimpleNamespace(device="cpu", attention_backend="cpu")) is None
    assert launcher.flash_attention_problem(SimpleNamespace(device="cpu", attention_backend="reference"))


def test_shard_output_reaches_the_launchers_log_with_its_rank(config, tmp_path, caplog):
    caplog.set_level(logging.INFO)

    def logged():
        return [r for r in caplog.records if r.name == "tgi_router.shard" and r.getMessage() == "loading model"]

    async def router(config, shard_failed, shutdown):
        for _ in range(500):
            if logged():
                return 0
            await asyncio.sleep(0.01)
        return 0

    run(config, tmp_path, serve=router)
    assert [(r.rank, r.levelno) for r in logged()] == [(0, logging.INFO)]


def test_shard_command_line_and_environment():
    config = parse_args(["--model-id", "org/m", "--revision", "abc", "--dtype", "bfloat16",
                         "--shard-uds-path", "/tmp/s", "--kv-cache-bytes", "1GiB", "--num-threads", "2",
                         "--master-addr", "10.0.0.2", "--master-port", "29600",
                         "--huggingface-hub-cache", "/data"], {})
    assert shard_command(config, 0) == [
        sys.executable, "-m", "tgi_server.cli", "serve", "org/m", "--uds-path", "/tmp/s", "--dtype",
        "bfloat16", "--revision", "abc", "--kv-cache-bytes", str(1 << 30), "--num-threads", "2"]
    env = shard_env(config, 0, {"PATH": "/bin", "LOG_LEVEL": "debug"})
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HF_HUB_CACHE",
                                "HUGGINGFACE_HUB_CACHE", "PATH", "LOG_LEVEL")} == {
        "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29600",
        "HF_HUB_CACHE": "/data", "HUGGINGFACE_HUB_CACHE": "/data", "PATH": "/bin", "LOG_LEVEL": "INFO"}


@pytest.mark.parametrize("tunables,passed", [
    (None, "glibc.malloc.hugetlb=1"),
    ("glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
    ("glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=0"),
])
def test_shards_get_malloc_s_huge_pages_unless_the_user_said(tunables, passed):
    base = {"PATH": "/bin"} | ({"GLIBC_TUNABLES": tunables} if tunables else {})
    assert shard_env(parse_args(["--model-id", "org/m"], {}), 0, base)["GLIBC_TUNABLES"] == passed


@pytest.mark.parametrize("argv,env,passed", [
    ([], {}, None),
    (["--kv-cache-dtype", "fp8_e4m3fn"], {}, "fp8_e4m3fn"),
    ([], {"KV_CACHE_DTYPE": "fp8_e5m2"}, "fp8_e5m2"),
])
def test_kv_cache_dtype_reaches_the_shard(argv, env, passed):
    command = shard_command(parse_args(argv, env), 0)
    if passed is None:
        assert "--kv-cache-dtype" not in command
    else:
        assert command[command.index("--kv-cache-dtype") + 1] == passed
        # the shard's own parser takes it
        from tgi_server.cli import build_parser, config_from_args
        assert config_from_args(build_parser().parse_args(command[3:])).kv_cache_dtype == passed


@pytest.mark.parametrize("argv,env,passed", [
    ([], {}, None),
    (["--rope-scaling", "dynamic"], {}, ["dynamic", "1.0"]),           # TGI: a scaling alone has factor 1
    (["--rope-factor", "2"], {}, ["linear", "2.0"]),                   # a factor alone is linear
    (["--rope-scaling", "yarn", "--rope-factor", "4"], {}, ["yarn", "4.0"]),
    ([], {"ROPE_SCALING": "linear", "ROPE_FACTOR": "1.5"}, ["linear", "1.5"]),
])
def test_rope_flags_reach_the_shard_paired_as_tgi_pairs_them(argv, env, passed):
    command = shard_command(parse_args(argv, env), 0)
    if passed is None:
        assert "--rope-scaling" not in command
    else:
        at = command.index("--rope-scaling")
        assert command[at:at + 4] == ["--rope-scaling", passed[0], "--rope-factor", passed[1]]


def test_watermark_flags_reach_the_shard_when_given():
    assert "--watermark-gamma" not in shard_command(parse_args([], {}), 0)
    command = shard_command(parse_args(["--watermark-gamma", "0.25"], {"WATERMARK_DELTA": "4"}), 0)
    assert command[command.index("--watermark-gamma") + 1] == "0.25"
    assert command[command.index("--watermark-delta") + 1] == "4.0"


def test_cuda_memory_fraction_reaches_the_shard_when_below_one():
    assert "--cuda-memory-fraction" not in shard_command(parse_args([], {}), 0)
    command = shard_command(parse_args([], {"CUDA_MEMORY_FRACTION": "0.5"}), 0)
    assert command[command.index("--cuda-memory-fraction") + 1] == "0.5"


def test_default_model_is_left_to_the_shard():
    assert shard_command(RouterConfig(), 0)[4:6] == ["--uds-path", "/tmp/text-generation-server"]


def test_json_log_lines_are_shaped_like_tgis(capsys):
    launcher.setup_logging(json_output=True)
    try:
        logging.getLogger("tgi_router.shard").info('say "hi"', extra={"rank": 1})
    finally:
        logging.getLogger().handlers.clear()
    entry = json.loads(capsys.readouterr().out)
    assert entry["level"] == "INFO" and entry["fields"] == {"message": 'say "hi"'}
    assert entry["span"] == {"rank": 1, "name": "shard-manager"} and entry["timestamp"].endswith("Z")


class _FakeShard:
    def __init__(self):
        self.health_calls = 0

    async def Health(self, request):
        self.health_calls += 1
        if self.health_calls < 3:
            raise RpcError(StatusCode.UNAVAILABLE, "warming")
        return pb.HealthResponse()

    async def Info(self, request):
        return pb.InfoResponse(model_id="fake", device="cpu", attention_backend="sdpa")


def test_wait_for_shards_polls_the_socket_then_health(tmp_path):
    config = RouterConfig(shard_uds_path=str(tmp_path / "s"))
    servicer = _FakeShard()

    async def scenario():
        waiting = asyncio.ensure_future(wait_for_shards(config))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # no socket yet
        server = Server({"Health": servicer.Health, "Info": servicer.Info})
        await server.start(f"{tmp_path / 's'}-0")
        try:
            return await asyncio.wait_for(waiting, 10)
        finally:
            await server.stop()

    info = asyncio.run(scenario())
    assert (info.model_id, info.attention_backend, servicer.health_calls) == ("fake", "sdpa", 3)
