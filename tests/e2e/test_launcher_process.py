"""The real launcher as users start it: flags, SIGTERM drain (with the
default model), and a shard that dies under load."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from ..shard_harness import save_tiny_served_model
from .router_harness import launch


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(save_tiny_served_model(tmp_path_factory.mktemp("launch") / "tiny", eos_token_id=None))


def shard_pid(proc: subprocess.Popen) -> int:
    out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    return int(out[0])


def huge_pages_expected() -> bool:
    """Transparent huge pages are not off here, and the C library is a glibc
    (2.35+) that reads glibc.malloc.hugetlb."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        name, _, version = os.confstr("CS_GNU_LIBC_VERSION").partition(" ")
    except (OSError, ValueError, AttributeError):
        return False
    return "[never]" not in mode and name == "glibc" and tuple(map(int, version.split(".")[:2])) >= (2, 35)


def anon_huge_kb(pid: int) -> int:
    return int(Path(f"/proc/{pid}/smaps_rollup").read_text().split("AnonHugePages:")[1].split()[0])


def test_bad_flag_is_one_line_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tgi_router.launch.launcher", "--max-input-tokens", "10",
                        "--max-total-tokens", "5"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


class Stream(threading.Thread):
    """A /generate_stream request on its own thread: `events` (the data
    lines' JSON), `first` set at the first one, `status` the HTTP status."""

    def __init__(self, url: str, inputs: str, **parameters):
        super().__init__()
        self.body = {"inputs": inputs, "parameters": parameters}
        self.url, self.events, self.first, self.status = url, [], threading.Event(), None
        self.start()

    def run(self):
        with httpx.stream("POST", self.url + "/generate_stream", json=self.body, timeout=60) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data:"):
                    self.events.append(json.loads(line[5:]))
                    self.first.set()


def test_killed_shard_fails_requests_turns_health_503_and_exits_nonzero(model, tmp_path):
    proc, url = launch(model, tmp_path)
    t = Stream(url, "Hello", max_new_tokens=900)
    assert t.first.wait(60)  # generating
    killed = time.time()
    os.kill(shard_pid(proc), signal.SIGKILL)
    t.join(10)
    assert not t.is_alive() and time.time() - killed < 5
    assert "error_type" in t.events[-1]
    assert httpx.get(url + "/health", timeout=5).status_code == 503
    # Left alone, the launcher would answer 503 for SHARD_FAILURE_GRACE_S (10 s)
    # and then exit 1 by itself (tests/router/test_launcher.py holds that wait).
    # A SIGTERM ends the grace at once, and a launch whose shard died still
    # exits 1, not the 0 of a clean drain.
    stopped = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 1 and time.monotonic() - stopped < 5


@pytest.mark.slow
def test_default_model_answers_with_real_text_and_sigterm_drains_a_stream(tmp_path):
    """SmolLM2 through the whole stack: launcher, router, shard (its large
    allocations on huge pages where the host has them). Then SIGTERM while a
    stream is generating: the stream runs to its end, and the launcher exits
    0. (The drain had a launch of the tiny model of its own before.)"""
    # Warmup prefills --max-batch-prefill-tokens (by default min(4096, the model's
    # 8192 positions): seconds of SmolLM2 on two cores); the prompt is 16 tokens.
    proc, url = launch(None, tmp_path, "--num-threads", "2", "--kv-cache-bytes", "64MiB", "--max-input-tokens", "64",
                       "--max-total-tokens", "128", "--max-batch-prefill-tokens", "64", default_limits=False)
    try:
        prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        r = httpx.post(url + "/generate", json={"inputs": prompt, "parameters": {
            "max_new_tokens": 20, "details": True}}, timeout=120)
        assert r.status_code == 200 and "Paris" in r.json()["generated_text"]
        assert r.json()["details"]["finish_reason"] == "eos_token"
        events = []
        with httpx.stream("POST", url + "/generate_stream", json={"inputs": prompt, "parameters": {
                "max_new_tokens": 20}}, timeout=120) as s:
            events = [line for line in s.iter_lines() if line.startswith("data:")]
        assert "Paris" in events[-1]
        if huge_pages_expected():  # the weights and KV cache on huge pages (shard_processes.shard_env)
            assert anon_huge_kb(shard_pid(proc)) > 64 << 10
        # SmolLM2 counts past 48 tokens (no EOS): the stream is still generating
        # when SIGTERM comes after its first token, and must get all 48.
        counting = "<|im_start|>user\nCount from 1 to 100, separated by commas.<|im_end|>\n<|im_start|>assistant\n"
        t = Stream(url, counting, max_new_tokens=48, details=True)
        assert t.first.wait(60)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert t.status == 200 and len(t.events) == 48
        assert t.events[-1]["details"]["finish_reason"] == "length"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
