"""Servers for HTTP tests on a free loopback port: the real launcher as a
process (`launch`), or in-process (`RunningServer`: a shard on a background
loop and serve_router on another) where a test needs to reach inside."""

import asyncio
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx

from tgi_router.launch.config import RouterConfig
from tgi_router.launch.server import serve_router

from ..shard_harness import InProcessShard, free_port


class RunningServer:
    """`url` serves the model at `model_path`; `shard` is the in-process shard.
    shard: one already serving (entered), for routers that follow each other
    on one loaded model; it is left serving when this server stops."""

    def __init__(self, tmp_path: Path, model_path: str, shard: InProcessShard | None = None, **config):
        tmp_path.mkdir(parents=True, exist_ok=True)
        self._own_shard = shard is None
        self.shard = shard or InProcessShard(tmp_path, model_path,
                                             kv_cache_bytes=config.pop("kv_cache_bytes", 16 << 20),
                                             speculative_model=config.get("speculative_model"))
        port = free_port()
        self.config = replace(RouterConfig(), model_id=model_path, hostname="127.0.0.1", port=port,
                              shard_uds_path=self.shard.config.uds_path, **config)
        self.url = f"http://127.0.0.1:{port}"
        self.exit_code: int | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        asyncio.set_event_loop(self._loop)
        self.shutdown, self.shard_failed = asyncio.Event(), asyncio.Event()
        self.exit_code = self._loop.run_until_complete(serve_router(self.config, self.shard_failed, self.shutdown))

    def __enter__(self) -> "RunningServer":
        if self._own_shard:
            self.shard.__enter__()
        self._thread.start()
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if not self._thread.is_alive():
                break
            time.sleep(0.1)
        raise RuntimeError("router did not become healthy")

    def stop(self) -> int | None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.shutdown.set)
            self._thread.join(30)
        return self.exit_code

    def __exit__(self, *exc):
        self.stop()
        if self._own_shard:
            self.shard.__exit__(*exc)


def launch(model: str | None, tmp_path, *flags, default_limits: bool = True,
           wait: bool = True) -> tuple[subprocess.Popen, str]:
    """model None: the default model (SmolLM2-135M-Instruct). The launcher's
    output (its shards' too) goes to tmp_path/launcher.log: an undrained pipe
    would fill up and block the launcher in its next log line. default_limits
    False: no --max-total-tokens / --max-input-tokens (the router derives them).
    wait False: returns once the launcher is started, for the caller to do
    other work while it loads, then `wait_launched`."""
    port = free_port()
    model_flags = ["--model-id", model] if model else []
    Path(tmp_path).mkdir(parents=True, exist_ok=True)
    log_path = Path(tmp_path) / "launcher.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tgi_router.launch.launcher", *model_flags, "--port", str(port),
             "--hostname", "127.0.0.1", "--shard-uds-path", str(tmp_path / "shard"), "--kv-cache-bytes", "16MiB",
             *(["--max-total-tokens", "1024", "--max-input-tokens", "512"] if default_limits else []), *flags],
            stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    if wait:
        wait_launched(proc, url, tmp_path)
    return proc, url


def wait_launched(proc: subprocess.Popen, url: str, tmp_path) -> None:
    """Until `launch`'s server answers /health; RuntimeError with its log
    (the launcher killed) if it exits first or takes over 180 s."""
    deadline = time.time() + 180  # shards load and warm up on a shared 2-core machine
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    proc.wait(30)
    raise RuntimeError(f"launcher did not start: {(Path(tmp_path) / 'launcher.log').read_text()}")
