"""The CPU image, built and served from as TGI's users start it: `docker run
-p …:80 -v MODEL:/data IMAGE FLAGS`, checked from outside the container.

The image (tests/deploy/conftest.py builds it) answers greedily as the pip
install does, launched here with the same flags. One container answers every
check: run as another user than root (any UID, as OpenShift assigns one) with
the model mounted read-only; the image's default user, root, serves under
compose (test_compose_up.py)."""

import json
import os
import threading

import httpx
import pytest

from deploy.image.container import Container

from ..e2e.router_harness import launch, wait_launched
from ..shard_harness import free_port
from .engine_at_hand import ENGINE, needs_engine

pytestmark = [pytest.mark.slow, needs_engine]
# The pip install's launcher in these tests gets the same limits, and serves
# eagerly (tests/conftest.py: TGI_CPU_COMPILE=0), as the container does; the
# kernel limits that make a newer CPU serve as an AVX2 one reach both. Warmup
# prefills --max-batch-prefill-tokens: 512, not TGI's 4096 (~16 s on two cores).
LIMITS = ["--max-total-tokens", "1024", "--max-input-tokens", "512", "--kv-cache-bytes", "64MiB",
          "--max-batch-prefill-tokens", "512"]
KERNEL_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
SERVING_ENV = {"TGI_CPU_COMPILE": "0", **{name: os.environ[name] for name in KERNEL_LIMITS if name in os.environ}}
PROMPT = "What is Deep Learning?"
CHAT = [{"role": "user", "content": "Name three colors."}]


def greedy(url: str) -> tuple[str, str]:
    """(/generate's text, /v1/chat/completions' content), greedy, 24 tokens each."""
    generated = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 24}},
                           timeout=120)
    chat = httpx.post(url + "/v1/chat/completions", json={"model": "tgi", "messages": CHAT, "max_tokens": 24,
                                                          "temperature": 0}, timeout=120)
    assert generated.status_code == 200 and chat.status_code == 200, (generated.text, chat.text)
    return generated.json()["generated_text"], chat.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def pip_launcher(tmp_path_factory):
    """The pip install's launcher, started and not waited for: `server`
    starts it before the container, so that both load at once."""
    tmp = tmp_path_factory.mktemp("pip")
    proc, url = launch(None, tmp, *LIMITS, wait=False)
    yield proc, url, tmp
    proc.terminate()
    proc.wait(60)


@pytest.fixture(scope="module")
def pip_answers(pip_launcher):
    """greedy() from the pip install's launcher, once it is healthy; it stops then."""
    proc, url, tmp = pip_launcher
    wait_launched(proc, url, tmp)
    try:
        return greedy(url)
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.fixture(scope="module")
def server(image, model_dir, pip_launcher):
    """The image as user 1001 (no such user in the image) with the model
    folder mounted read-only; flags both as arguments (--max-stop-sequences)
    and as environment variables (MAX_CONCURRENT_REQUESTS, MAX_BATCH_SIZE)."""
    flags = ["--model-id", "/data", *LIMITS, "--max-stop-sequences", "3"]
    env = {**SERVING_ENV, "MAX_CONCURRENT_REQUESTS": "17", "MAX_BATCH_SIZE": "2"}
    with Container.start(ENGINE, image, flags, free_port(), env=env, mounts=[f"{model_dir}:/data:ro"],
                         user="1001") as container:
        container.wait_healthy()
        yield container


def test_health_is_200_once_ready(server):
    assert server.health() == 200


def test_any_user_serves_a_read_only_model_mount(server):
    """The launcher (the container's first process) runs as 1001; /data
    cannot be written. Its answers: test_generate_and_chat_answer_as_the_pip_install."""
    assert server.exec("sh", "-c", "grep -Eq '^Uid:[[:space:]]+1001[[:space:]]' /proc/1/status") == 0
    assert server.exec("sh", "-c", "! touch /data/written") == 0


def test_generate_and_chat_answer_as_the_pip_install(server, pip_answers):
    assert greedy(server.url) == pip_answers


def test_metrics_have_tgis_counters(server):
    httpx.post(server.url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, timeout=60)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("tgi_request_count", "tgi_request_success", "tgi_request_generated_tokens",
                 "tgi_request_duration", "tgi_batch_current_size", "tgi_queue_size"):
        assert f"\n{name}" in text, name
    assert any(line.startswith("tgi_request_success ") and float(line.split()[1]) >= 1
               for line in text.splitlines())


def test_the_images_healthcheck_command_passes(server, image):
    """The HEALTHCHECK the engine runs, run as it would: in the container."""
    config = ENGINE("image", "inspect", "--format", "{{json .Config.Healthcheck}}", image).stdout
    check = json.loads(config)
    assert check and check["Test"][0] == "CMD-SHELL", config  # podman keeps it only in docker's format
    assert server.exec("sh", "-c", check["Test"][1]) == 0


def test_flags_reach_the_launcher_as_arguments_and_as_environment(server):
    info = httpx.get(server.url + "/info", timeout=10).json()
    assert (info["max_stop_sequences"], info["max_concurrent_requests"]) == (3, 17)
    assert "max_batch_size=2" in server.logs()  # the launcher's logged Args


def test_docker_stop_drains_an_in_flight_stream_and_exits_0(server):
    """The last test on `server`: it stops it. SIGTERM comes after the first
    token of 120; the stream still ends with all of them (a SIGKILL at the
    timeout would exit 137), and the container exits 0."""
    events, first = [], threading.Event()

    def stream():
        with httpx.stream("POST", server.url + "/generate_stream", timeout=120, json={
                "inputs": PROMPT, "parameters": {"max_new_tokens": 120, "details": True}}) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    first.set()
    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(60)
    assert server.stop(timeout=60) == 0
    reader.join(60)
    assert events[-1]["details"]["finish_reason"] == "length"
    assert events[-1]["details"]["generated_tokens"] == 120
