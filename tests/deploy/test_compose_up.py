"""docker-compose.yml brought up for real: its CPU server comes up under
podman-compose (or `docker compose` where docker's daemon runs), answers, and
passes its own healthcheck. Prometheus and Grafana come from a registry:
where their images cannot be pulled, their tests skip and name them."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from deploy.image.container import Container

from ..shard_harness import free_port
from .doc_snippets import ROOT
from .engine_at_hand import ENGINE, needs_engine

COMPOSE_FILE = ROOT / "docker-compose.yml"
SERVICES = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
PROJECT = "tgi-py-test"
pytestmark = [pytest.mark.slow, needs_engine]


def compose_command() -> list[str]:
    if ENGINE.name == "docker":
        return ["docker", "compose"]
    # The venv's scripts, where pytest runs from the venv without it on PATH.
    podman_compose = shutil.which("podman-compose", path=f"{Path(sys.executable).parent}{os.pathsep}"
                                  f"{os.environ.get('PATH', '')}")
    if podman_compose is None:
        pytest.skip("podman-compose is not installed (the `test` extra installs it)")
    # podman's global flags and run ulimits as every other podman call here.
    return [podman_compose, "--podman-args", " ".join(ENGINE.command[1:]),
            "--podman-run-args", " ".join(ENGINE.run_flags)]


def compose(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*compose_command(), "-f", str(COMPOSE_FILE), "-p", PROJECT, "--profile", "cpu", *args],
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def compose_env(model_dir) -> tuple[dict[str, str], int]:
    """The environment compose interpolates the file with (the model folder
    at /data, small limits, a warmup of 512 prefill tokens rather than 4096,
    a free port), and that port."""
    port = free_port()
    return {**os.environ, "CPU_MODEL_ID": "/data", "DATA_DIR": str(model_dir), "CPU_PORT": str(port),
            "KV_CACHE_BYTES": "64MiB", "MAX_INPUT_TOKENS": "512", "MAX_TOTAL_TOKENS": "1024",
            "MAX_BATCH_PREFILL_TOKENS": "512", "TGI_CPU_COMPILE": "0"}, port


def test_cpu_server_comes_up_healthy_under_compose(image, compose_env):
    """As the image's default user, root (test_image.py runs it as another)."""
    env, port = compose_env
    up = compose("up", "-d", "tgi-cpu", env=env)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        server = Container(ENGINE, container_of("tgi-cpu"), port)
        server.wait_healthy(timeout=600)
        answer = httpx.post(server.url + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}},
                            timeout=60)
        assert answer.status_code == 200 and answer.json()["generated_text"]
        # The compose file's own healthcheck, run by the engine (docker runs it in the container).
        if ENGINE.name == "podman":
            check = ENGINE("healthcheck", "run", server.name, check=False, timeout=60)
            assert check.returncode == 0, check.stdout + check.stderr
        else:
            assert server.exec("sh", "-c", SERVICES["tgi-cpu"]["healthcheck"]["test"][1].replace("$$", "$")) == 0
    finally:
        down = compose("down", "-t", "30", env=env)
        assert down.returncode == 0, down.stdout + down.stderr


@pytest.mark.parametrize("service", ["prometheus", "grafana"])
def test_registry_services_come_up_where_their_images_can_be_pulled(service, compose_env):
    image = SERVICES[service]["image"]
    if ENGINE("pull", image, check=False, timeout=600).returncode != 0:
        pytest.skip(f"{service}: its image {image} cannot be pulled here (no registry reachable)")
    env, _ = compose_env
    try:
        up = compose("up", "-d", "--no-deps", service, env=env)
        assert up.returncode == 0, up.stdout + up.stderr
        assert ENGINE("inspect", "--format", "{{.State.Running}}", container_of(service)).stdout.strip() == "true"
    finally:
        compose("down", "-t", "10", env=env)


def container_of(service: str) -> str:
    """The container compose started for SERVICE (its name differs between
    podman-compose and docker compose)."""
    names = ENGINE("ps", "--filter", f"label=com.docker.compose.service={service}",
                   "--filter", f"label=com.docker.compose.project={PROJECT}", "--format", "{{.Names}}").stdout.split()
    assert len(names) == 1, names
    return names[0]

