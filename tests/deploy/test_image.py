"""The CPU image, built and served from as TGI's users start it: `docker run
-p …:80 -v MODEL:/data IMAGE FLAGS`, checked from outside the container.

The image (tests/deploy/conftest.py builds it) answers greedily as the pip
install does, launched here with the same flags."""

import json
import os
import threading

import httpx
import pytest

from deploy.image.container import Container

from ..e2e.router_harness import launch
from ..shard_harness import free_port
from .engine_at_hand import ENGINE, needs_engine

pytestmark = [pytest.mark.slow, needs_engine]
# The pip install's launcher in these tests gets the same limits, and serves
# eagerly (tests/conftest.py: TGI_CPU_COMPILE=0), as the container does; the
# kernel limits that make a newer CPU serve as an AVX2 one reach both.
LIMITS = ["--max-total-tokens", "1024", "--max-input-tokens", "512", "--kv-cache-bytes", "64MiB"]
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
def pip_answers(tmp_path_factory):
    """greedy() from the pip install's launcher (`launch` waits until it is healthy)."""
    proc, url = launch(None, tmp_path_factory.mktemp("pip"), *LIMITS)
    try:
        return greedy(url)
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.fixture(scope="module")
def server(image, model_dir):
    """The image as root: flags both as arguments (--max-stop-sequences) and as
    environment variables (MAX_CONCURRENT_REQUESTS, MAX_BATCH_SIZE)."""
    flags = ["--model-id", "/data", *LIMITS, "--max-stop-sequences", "3"]
    env = {**SERVING_ENV, "MAX_CONCURRENT_REQUESTS": "17", "MAX_BATCH_SIZE": "2"}
    with Container.start(ENGINE, image, flags, free_port(), env=env, mounts=[f"{model_dir}:/data"]) as container:
        container.wait_healthy()
        yield container


def test_health_is_200_once_ready(server):
    assert server.health() == 200


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
    timeout would exit 137)."""
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


def test_any_user_serves_a_read_only_model_mount(image, model_dir, pip_answers):
    flags = ["--model-id", "/data", *LIMITS]
    with Container.start(ENGINE, image, flags, free_port(), env=SERVING_ENV, mounts=[f"{model_dir}:/data:ro"],
                         user="1001") as container:
        container.wait_healthy()
        assert greedy(container.url) == pip_answers
        assert container.stop(timeout=60) == 0
