"""`text-generation-launcher`: TGI's flags in, one shard process per rank,
then the router in this process.

Life of a launch: parse (a bad value or combination: one line on stderr, exit
2) -> start the shards -> wait until each answers Health (a shard that exits
first: its stderr line, exit 1) -> `serve_router(config, shard_failed,
shutdown)` until it returns. SIGTERM/SIGINT set `shutdown`: the router drains
within --graceful-termination-timeout and returns its exit code (a second
SIGINT stops it at once). A shard that exits while serving sets
`shard_failed` (in-flight requests fail, /health answers 503); the router may
return by itself, else `shutdown` follows after SHARD_FAILURE_GRACE_S; the
launcher then exits 1. In every case the shards are stopped last (SIGTERM,
SIGKILL after SHARD_STOP_TIMEOUT_S). Progress is logged as text or, with
--json-output, JSON lines shaped like TGI's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from tgi_router.launch.config import ConfigError, RouterConfig, parse_args
from tgi_router.launch.shard_processes import (
    ShardExit,
    ShardGroup,
    remove_stale_sockets,
    shard_command,
    shard_env,
    wait_for_shards,
)

log = logging.getLogger("tgi_router.launch.launcher")

SHARD_STOP_TIMEOUT_S = 5.0     # SIGTERM -> SIGKILL
SHARD_FAILURE_GRACE_S = 10.0   # after a shard dies, /health answers 503 this long at most
DRAIN_MARGIN_S = 5.0           # beyond --graceful-termination-timeout before the router is cancelled

Serve = Callable[[RouterConfig, asyncio.Event, asyncio.Event], Awaitable[int]]


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> None:
    env = os.environ if env is None else env
    try:
        config = parse_args(argv, env)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    setup_logging(config.json_output, config.log_level)
    sys.exit(asyncio.run(launch(config, env)))


class _State:
    """The two events shared with the router, and the router's task."""

    def __init__(self) -> None:
        self.shutdown = asyncio.Event()
        self.shard_failed = asyncio.Event()
        self.router: asyncio.Future | None = None

    def on_signal(self, sig: signal.Signals) -> None:
        if not self.shutdown.is_set():
            log.info("Received %s: draining requests, then stopping", sig.name)
            self.shutdown.set()
        elif sig == signal.SIGINT and self.router is not None and not self.router.done():
            # A second Ctrl-C stops at once; a repeated SIGTERM only drains (as uvicorn).
            log.warning("Received %s again: stopping now", sig.name)
            self.router.cancel()


async def launch(config: RouterConfig, env: Mapping[str, str], *,
                 command: Callable[[RouterConfig, int], list[str]] = shard_command,
                 ready: Callable[[RouterConfig], Awaitable[Any]] = wait_for_shards,
                 serve: Serve | None = None) -> int:
    """Runs one launch and returns the process exit code. `command` builds a
    rank's command line, `ready` waits for the shards and returns rank 0's
    Info, `serve` is tgi_router.launch.server.serve_router unless given."""
    loop, state, group = asyncio.get_running_loop(), _State(), ShardGroup()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, state.on_signal, sig)
    # The web stack (FastAPI, pydantic models: ~0.4 s of imports) loads on a
    # thread while the shards start, instead of after they are ready.
    router_module = None if serve is not None else asyncio.ensure_future(
        asyncio.to_thread(importlib.import_module, "tgi_router.launch.server"))
    try:
        _log_start(config)
        code = await _start(config, env, group, command, ready, state)
        if code is None:
            code = await _serve(config, group, serve or (await router_module).serve_router, state)
        return code
    finally:
        if router_module is not None:  # a thread cannot be cancelled: it ends before the shards stop
            await asyncio.gather(router_module, return_exceptions=True)
        await group.stop(SHARD_STOP_TIMEOUT_S)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def _log_start(config: RouterConfig) -> None:
    shown = dataclasses.replace(config, api_key="<redacted>") if config.api_key else config
    log.info("Args %s", shown)
    for flag in config.ignored_flags:
        log.warning("%s has no effect here (accepted for compatibility with TGI)", flag)
    if config.trust_remote_code:
        log.warning("`trust_remote_code` is set, but no code from the hub is ever run here")


async def _start(config: RouterConfig, env: Mapping[str, str], group: ShardGroup,
                 command: Callable[[RouterConfig, int], list[str]],
                 ready: Callable[[RouterConfig], Awaitable[Any]], state: _State) -> int | None:
    """Starts the shards and waits for them; an exit code, or None to serve."""
    remove_stale_sockets(config)
    try:
        for rank in range(config.num_shard):
            await group.start(rank, command(config, rank), shard_env(config, rank, env))
    except OSError as err:
        return _fail(f"the shard could not start: {err}", 1)
    waiting = asyncio.ensure_future(ready(config))
    exited = asyncio.ensure_future(group.wait_first_exit())
    stopping = asyncio.ensure_future(state.shutdown.wait())
    await asyncio.wait({waiting, exited, stopping}, return_when=asyncio.FIRST_COMPLETED)
    for task in (waiting, exited, stopping):
        task.cancel()
    await asyncio.gather(waiting, exited, stopping, return_exceptions=True)
    if exited.done() and not exited.cancelled():
        return _fail(exited.result().describe(" during start-up"), 1)
    if stopping.done() and not stopping.cancelled():
        log.info("Stopped before the shards were ready")
        return 0
    if waiting.cancelled() or waiting.exception() is not None:
        return _fail(f"the shards did not become ready: {waiting.exception()!r}", 1)
    info = waiting.result()
    log.info("Shards ready: model %s, %s on %s, attention backend %s",
             info.model_id, info.dtype, info.device, info.attention_backend)
    if config.flash_attention and (problem := flash_attention_problem(info)):
        return _fail(problem, 2)
    return None


def flash_attention_problem(info: Any) -> str | None:
    """Why --flash-attention cannot be honoured, or None: flash-style means
    flash-attn on CUDA, or on CPU our C++ kernels (online softmax) or torch's fused SDPA."""
    device, backend = str(info.device), str(info.attention_backend)
    if backend == "flash_attn" or (device == "cpu" and backend in ("cpu", "sdpa")):
        return None
    if device == "cpu":
        wanted = "our C++ kernels or torch's fused SDPA"
    else:
        wanted = "flash-attn (is the flash_attn package installed?)"
    return (f"--flash-attention: the shards run the {backend!r} attention backend on {device}, "
            f"not a flash-style one; {device} needs {wanted}")


async def _serve(config: RouterConfig, group: ShardGroup, serve: Serve, state: _State) -> int:
    loop = asyncio.get_running_loop()
    log.info("Starting Webserver")
    router = state.router = asyncio.ensure_future(serve(config, state.shard_failed, state.shutdown))
    watcher = asyncio.ensure_future(group.wait_first_exit())
    stopping = asyncio.ensure_future(state.shutdown.wait())
    try:
        await asyncio.wait({router, watcher, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if watcher.done() and not router.done():
            _shard_died(watcher.result(), state)
            await asyncio.wait({router}, timeout=SHARD_FAILURE_GRACE_S)
            state.shutdown.set()
        if not router.done():  # draining
            deadline = loop.time() + config.graceful_termination_timeout + DRAIN_MARGIN_S
            if not watcher.done():
                await asyncio.wait({router, watcher}, timeout=deadline - loop.time(),
                                   return_when=asyncio.FIRST_COMPLETED)
                if watcher.done() and not router.done():
                    _shard_died(watcher.result(), state)
            await asyncio.wait({router}, timeout=max(0.0, deadline - loop.time()))
        if not router.done():
            log.error("The router did not stop within the grace period: stopping it")
    finally:
        for task in (router, watcher, stopping):
            task.cancel()
        await asyncio.gather(router, watcher, stopping, return_exceptions=True)
    code = _router_code(router)
    failed = watcher.done() and not watcher.cancelled()
    return 1 if failed and code == 0 else code


def _shard_died(exit: ShardExit, state: _State) -> None:
    _fail(exit.describe(" while serving") + " (in-flight requests fail)", None)
    state.shard_failed.set()


def _router_code(router: asyncio.Future) -> int:
    if router.cancelled():
        return 1
    if isinstance(err := router.exception(), ConfigError):
        return _fail(str(err), 2)
    if err is not None:
        log.error("The router failed", exc_info=err)
        return _fail(f"the router failed: {err!r}", 1)
    return int(router.result() or 0)


def _fail(message: str, code: int | None) -> int | None:
    """Logs the error and writes it as one line on stderr."""
    log.error("%s", message)
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


# -- logging ------------------------------------------------------------------

class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rank = getattr(record, "rank", None)
        return line if rank is None else f"{line} rank={rank}"


class _JsonFormatter(logging.Formatter):
    """One JSON object a line, shaped as TGI's (tracing's JSON format)."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created, timezone.utc)
        entry: dict[str, Any] = {
            "timestamp": stamp.isoformat(timespec="microseconds").replace("+00:00", "Z"),
            "level": "WARN" if record.levelno == logging.WARNING else record.levelname,
            "fields": {"message": record.getMessage()},
            "target": record.name,
        }
        if (rank := getattr(record, "rank", None)) is not None:
            entry["span"] = {"rank": rank, "name": "shard-manager"}
        if record.exc_info:
            entry["fields"]["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, separators=(",", ":"))


def setup_logging(json_output: bool, level: str = "info") -> None:
    """Logs of the launcher, the router and the shards go to stdout; stderr
    carries only one-line errors."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_JsonFormatter() if json_output
                         else _TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


if __name__ == "__main__":
    main()
