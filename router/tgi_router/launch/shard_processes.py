"""The shard child processes of one launch: one `text-generation-server serve`
per rank, their output streamed into the launcher's log, the first one to exit
noticed, all of them stopped (SIGTERM, then SIGKILL); and the wait until every
shard's socket answers Health."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import re
import signal
import sys
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tgi_router.launch.config import RouterConfig

log = logging.getLogger("tgi_router.launch.launcher")
shard_log = logging.getLogger("tgi_router.shard")

READY_POLL_S = 0.1
WAITING_LOG_EVERY_S = 10.0
_LINE_LIMIT = 1 << 20
# The shard's text log format: "2026-01-01 12:00:00,123 INFO tgi_server: message".
_SHARD_LINE = re.compile(r"^\d{4}-\d\d-\d\d[ T][\d:.,]+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: (.*)$")
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def shard_command(config: RouterConfig, rank: int) -> list[str]:
    """The shard CLI, run with this interpreter so that the launcher's
    environment is the shard's whatever PATH says."""
    command = [sys.executable, "-m", "tgi_server.cli", "serve"]
    if config.model_id:
        command.append(config.model_id)
    command += ["--uds-path", config.shard_uds_path]
    # Ranks share the CPU: torch's default (every core each) would oversubscribe it.
    threads = config.num_threads or (max(1, (os.cpu_count() or 1) // config.num_shard)
                                     if config.num_shard > 1 else 0)
    for flag, value in (("--dtype", config.dtype), ("--revision", config.revision), ("--quantize", config.quantize),
                        ("--kv-cache-bytes", config.kv_cache_bytes), ("--num-threads", threads),
                        # None: the shard's default for its device; (): "0", none.
                        ("--cuda-graphs", None if config.cuda_graphs is None
                         else ",".join(map(str, config.cuda_graphs)) or "0"),
                        ("--kv-cache-dtype", config.kv_cache_dtype),
                        ("--speculative-model", config.speculative_model)):
        if value:
            command += [flag, str(value)]
    for flag, value in (("--watermark-gamma", config.watermark_gamma), ("--watermark-delta", config.watermark_delta)):
        if value is not None:
            command += [flag, str(value)]
    if config.lora_adapters:
        command += ["--lora-adapters", config.lora_adapters]
    if config.cuda_memory_fraction != 1.0:
        command += ["--cuda-memory-fraction", str(config.cuda_memory_fraction)]
    if rope := rope_override(config):
        command += ["--rope-scaling", rope[0], "--rope-factor", str(rope[1])]
    return command


def rope_override(config: RouterConfig) -> tuple[str, float] | None:
    """TGI's pairing of --rope-scaling and --rope-factor: a scaling without a
    factor has factor 1.0, a factor without a scaling is linear."""
    if config.rope_scaling is None and config.rope_factor is None:
        return None
    return config.rope_scaling or "linear", 1.0 if config.rope_factor is None else config.rope_factor


# glibc's malloc asks for transparent huge pages (madvise) on the memory it
# maps: the weights, the KV cache, each step's activations. Linux's default
# THP mode ("madvise") gives a process none otherwise, and a decode step
# streams all the weights (~270 MB for SmolLM2 in bf16) through 4 KB pages,
# a TLB miss each (figures: docs/tuning.md#huge-pages). Ignored where THP is
# off or the C library is not glibc >= 2.35.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def shard_env(config: RouterConfig, rank: int, base: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment plus torch.distributed's variables and the
    hub cache (TGI's shard_manager), and malloc's huge pages unless
    GLIBC_TUNABLES already says how (glibc.malloc.hugetlb=0 keeps them off)."""
    env = dict(base)
    env.update(RANK=str(rank), WORLD_SIZE=str(config.num_shard), MASTER_ADDR=config.master_addr,
               MASTER_PORT=str(config.master_port), LOG_LEVEL=config.log_level.upper(),
               PYTHONUNBUFFERED="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    if config.huggingface_hub_cache:
        env["HF_HUB_CACHE"] = env["HUGGINGFACE_HUB_CACHE"] = config.huggingface_hub_cache
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb=" not in tunables:
        env["GLIBC_TUNABLES"] = f"{tunables}:{HUGE_PAGES_TUNABLE}" if tunables else HUGE_PAGES_TUNABLE
    return env


def socket_paths(config: RouterConfig) -> list[str]:
    return [f"{config.shard_uds_path}-{rank}" for rank in range(config.num_shard)]


@dataclass(frozen=True)
class ShardExit:
    rank: int
    returncode: int       # negative: killed by that signal
    stderr: str           # the last line the shard wrote to stderr, "" if none

    def describe(self, when: str = "") -> str:
        """'shard 0 exited with code 1{when}: {its last stderr line}'."""
        how = (f"was killed by signal {-self.returncode}" if self.returncode < 0
               else f"exited with code {self.returncode}")
        return f"shard {self.rank} {how}{when}" + (f": {self.stderr}" if self.stderr else "")


class _Shard:
    def __init__(self, rank: int, process: asyncio.subprocess.Process):
        self.rank, self.process = rank, process
        self.stderr_tail: deque[str] = deque(maxlen=20)
        self.readers = [asyncio.ensure_future(self._pump(process.stdout, logging.INFO, None)),
                        asyncio.ensure_future(self._pump(process.stderr, logging.WARNING, self.stderr_tail))]

    async def _pump(self, stream: asyncio.StreamReader, level: int, tail: deque | None) -> None:
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line over the limit: dropped, the stream goes on
                continue
            if not raw:
                return
            text = raw.decode(errors="replace").rstrip()
            if not text:
                continue
            if tail is not None:
                tail.append(text)
            match = _SHARD_LINE.match(text)
            shard_log.log(logging.getLevelName(match[1]) if match else level,
                          "%s", match[2] if match else text, extra={"rank": self.rank})


class ShardGroup:
    """The running shards of one launch; `stop` must be awaited in the end."""

    def __init__(self) -> None:
        self._shards: list[_Shard] = []

    async def start(self, rank: int, command: list[str], env: Mapping[str, str]) -> None:
        """Spawns one shard in its own session; raises OSError if it cannot."""
        log.info("Starting shard", extra={"rank": rank})
        process = await asyncio.create_subprocess_exec(
            *command, env=dict(env), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True, limit=_LINE_LIMIT,
            preexec_fn=_die_with_parent)
        self._shards.append(_Shard(rank, process))

    async def wait_first_exit(self) -> ShardExit:
        """Returns when any shard has exited (lowest rank first on a tie)."""
        if not self._shards:
            await asyncio.Future()  # nothing can exit
        waits = {asyncio.ensure_future(s.process.wait()): s for s in self._shards}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        shard = min((waits[w] for w in done), key=lambda s: s.rank)
        await asyncio.wait(shard.readers, timeout=1.0)  # its last words
        return ShardExit(shard.rank, shard.process.returncode,
                         shard.stderr_tail[-1] if shard.stderr_tail else "")

    async def stop(self, timeout: float) -> None:
        """SIGTERM to every running shard, SIGKILL to those still running
        after `timeout` seconds; then waits for all and their output."""
        running = [s for s in self._shards if s.process.returncode is None]
        for s in running:
            log.info("Terminating shard", extra={"rank": s.rank})
            _signal(s.process, signal.SIGTERM)
        if running:
            await asyncio.wait([asyncio.ensure_future(s.process.wait()) for s in running], timeout=timeout)
        for s in running:
            if s.process.returncode is None:
                log.warning("Killing shard: still running %.0f s after SIGTERM", timeout,
                            extra={"rank": s.rank})
                _signal(s.process, signal.SIGKILL)
        await asyncio.gather(*(s.process.wait() for s in running))
        readers = [r for s in self._shards for r in s.readers]
        if readers:
            await asyncio.wait(readers, timeout=1.0)
        for r in readers:
            r.cancel()


def _signal(process: asyncio.subprocess.Process, sig: int) -> None:
    # The shard leads its own process group (start_new_session): signal the
    # group so that helpers it spawned stop with it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def _die_with_parent() -> None:
    # Runs in the child before exec: on Linux, SIGTERM reaches the shard if
    # the launcher dies without stopping it (PR_SET_PDEATHSIG = 1).
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM, 0, 0, 0)


def remove_stale_sockets(config: RouterConfig) -> None:
    """Sockets left by an earlier run would look ready (TGI removes them too)."""
    for path in socket_paths(config):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


async def wait_for_shards(config: RouterConfig) -> Any:
    """Waits until every shard's socket exists and answers Health, then
    returns rank 0's InfoResponse. Logs progress every few seconds; never
    gives up (a shard that dies is noticed by its ShardGroup)."""
    from tgi_router.scheduling.client import ShardClient, ShardError

    started = last_log = time.monotonic()
    paths = socket_paths(config)
    for rank, path in enumerate(paths):
        while not os.path.exists(path):
            if time.monotonic() - last_log >= WAITING_LOG_EVERY_S:
                log.info("Waiting for shard to be ready...", extra={"rank": rank})
                last_log = time.monotonic()
            await asyncio.sleep(READY_POLL_S)
        log.info("Shard ready in %.1f s", time.monotonic() - started, extra={"rank": rank})
    client = ShardClient(paths)
    try:
        while True:
            try:
                await client.health(timeout=10.0)
                return await client.info()
            except ShardError as err:  # the socket exists before gRPC serves on it
                if time.monotonic() - last_log >= WAITING_LOG_EVERY_S:
                    log.info("Waiting for shards to answer Health: %s", err)
                    last_log = time.monotonic()
                await asyncio.sleep(READY_POLL_S)
    finally:
        await client.close()
