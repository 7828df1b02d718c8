"""Image benchmark (`make bench BENCH=image`): the CPU image's size, and its
cold start to a healthy `/health` for the default model (SmolLM2-135M-
Instruct's GGUF, mounted at /data) against the pip install's launcher
serving the same file with the same flags, taking turns.

Cold means nothing compiled at start: a new container has an empty /tmp, so
the pip install gets a new torch.compile cache folder each start as well (the
C++ kernels are prebuilt in both: in the image, and by `make install`). Each
start is timed from the command (`run -d`, or the launcher's exec) to the
first 200 from /health, polled every 0.1 s. Once as served by default
(decode steps compiled at warmup), once eagerly (TGI_CPU_COMPILE=0)."""

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from deploy.image.build import DEFAULT_TAG, build_image
from deploy.image.container import Container
from deploy.image.engine import Engine, detect
from tgi_server.weights.resolve import default_model_path

from .http import free_port

IMAGE = DEFAULT_TAG["cpu"]
ROUNDS = {"default": 2, "eager": 3}
MODES = {"default": {}, "eager": {"TGI_CPU_COMPILE": "0"}}


def container_start(engine: Engine, model_dir: str, env: dict[str, str]) -> float:
    start = time.monotonic()
    with Container.start(engine, IMAGE, ["--model-id", "/data"], free_port(), env=env,
                         mounts=[f"{model_dir}:/data:ro"]) as c:
        c.wait_healthy(timeout=900)
        elapsed = time.monotonic() - start
        c.stop(timeout=60)
    return elapsed


def pip_start(model_dir: str, env: dict[str, str]) -> float:
    launcher = shutil.which("text-generation-launcher", path=str(Path(sys.executable).parent))
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        proc = subprocess.Popen(
            [launcher, "--model-id", model_dir, "--port", str(port), "--hostname", "127.0.0.1",
             "--shard-uds-path", f"{tmp}/shard"],
            env={**os.environ, **env, "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor"},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while proc.poll() is None:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        return time.monotonic() - start
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            raise RuntimeError(f"the pip install's launcher exited ({proc.returncode}) before it was healthy")
        finally:
            proc.terminate()
            proc.wait(60)


def run() -> dict:
    engine = detect()
    if engine is None:
        print("image: no container engine (docker with a running daemon, or podman): not measured", flush=True)
        return {"image_engine": None}
    start = time.monotonic()
    build_image(engine, "cpu", IMAGE)
    build_s = time.monotonic() - start
    size = int(engine("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout.strip())
    results = {"image_engine": engine.describe(), "image_size_gb": round(size / 1e9, 3),
               "image_build_s": round(build_s, 1)}
    with tempfile.TemporaryDirectory() as model_dir:
        gguf = default_model_path()
        shutil.copy(gguf, Path(model_dir) / gguf.name)
        os.chmod(model_dir, 0o755)
        for mode, env in MODES.items():
            image_s, pip_s = [], []
            for _ in range(ROUNDS[mode]):
                image_s.append(container_start(engine, model_dir, env))
                pip_s.append(pip_start(model_dir, env))
            print(f"image: cold start to healthy ({mode}), container {[round(s, 1) for s in image_s]} s, "
                  f"pip install {[round(s, 1) for s in pip_s]} s", flush=True)
            suffix = "" if mode == "default" else f"_{mode}"
            image_med, pip_med = statistics.median(image_s), statistics.median(pip_s)
            results |= {f"image_start{suffix}_s": round(image_med, 2), f"pip_start{suffix}_s": round(pip_med, 2),
                        f"image_start{suffix}_vs_pip": round(image_med / pip_med, 3)}
    print(f"image: {IMAGE} {results['image_size_gb']} GB ({engine.describe()}; build or cache check "
          f"{build_s:.0f} s)", flush=True)
    return results
