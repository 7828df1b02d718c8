"""--num-shard N through the real launcher: N shard processes joined by gloo
give the same text over HTTP as one shard, and a rank that dies fails the
requests in flight, turns /health to 503 and makes rank 0 fail at once.
(SmolLM2's GGUF over three ranks, greedy and seeded, is checked a layer down,
in tests/server/test_tensor_parallel.py.)"""

import asyncio
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tgi_proto.rpc import StatusCode
from tgi_router.scheduling.client import ShardClient, ShardError
from tgi_server.distributed import COLLECTIVE_TIMEOUT_S

from ..shard_harness import save_tiny_served_model, torch_threads
from .router_harness import RunningServer, free_port, launch

PROMPTS = ["Hello", "The weather today", "Once upon a time", "1, 2, 3,", "Paris is",
           "Write a poem", "def main():", "The quick brown fox"]


GREEDY = {"max_new_tokens": 16}
SEEDED = {"max_new_tokens": 16, "do_sample": True, "temperature": 0.8, "seed": 7}


def generated(url: str, prompt: str, parameters: dict) -> str:
    return httpx.post(url + "/generate", json={"inputs": prompt, "parameters": parameters},
                      timeout=120).json()["generated_text"]


def answers(url: str) -> tuple[list[str], list[str]]:
    """(greedy texts, seeded sampled texts) of PROMPTS, one request at a time:
    concurrent requests would share batches whose make-up varies with arrival
    order, and in float32 a text then depends on it."""
    return [generated(url, p, GREEDY) for p in PROMPTS], [generated(url, p, SEEDED) for p in PROMPTS]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """8 attention heads, 4 KV heads: 4 + 2 per rank at N=2."""
    path = tmp_path_factory.mktemp("tp") / "tiny"
    return str(save_tiny_served_model(path, eos_token_id=None, num_attention_heads=8, num_key_value_heads=4))


@pytest.fixture(scope="module")
def two_shards(tiny, tmp_path_factory):
    """(launcher process, url, its directory): the tiny model on two ranks,
    one launch for both tests; test_a_dead_rank_... ends it, so it runs last.
    float32: in bf16 (the default on this CPU) the ranks' partial sums round
    differently from one GEMM's, enough to move a seeded draw from the random
    model's nearly flat distribution."""
    tmp = tmp_path_factory.mktemp("n2")
    proc, url = launch(tiny, tmp, "--num-shard", "2", "--master-port", str(free_port()), "--dtype", "float32")
    yield proc, url, tmp
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def test_two_shards_answer_as_one(tiny, two_shards, tmp_path):
    """The reference is one shard in this process (float32, the router's code
    as the launcher runs it), not a second launch."""
    _, url, _ = two_shards
    with torch_threads(1), RunningServer(tmp_path, tiny, max_total_tokens=1024, max_input_tokens=512) as one:
        expected = answers(one.url)
    assert answers(url) == expected


def rank_0_health(tmp) -> None:
    async def go():
        client = ShardClient([str(tmp / "shard-0")], timeout=60)
        try:
            await client.health()
        finally:
            await client.close()
    asyncio.run(go())


def batch_size(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(r"^tgi_batch_current_size (\S+)$", text, re.M).group(1))


def ranks_of(proc: subprocess.Popen) -> dict[int, int]:
    """rank -> pid of the launcher's shard processes (their RANK variable)."""
    pids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    environ = {pid: Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") for pid in pids}
    return {int(next(v for v in env if v.startswith(b"RANK="))[5:]): int(pid) for pid, env in environ.items()}


def test_a_dead_rank_fails_in_flight_requests_and_health(two_shards):
    proc, url, tmp = two_shards
    ranks = ranks_of(proc)
    assert sorted(ranks) == [0, 1]
    result = {}

    def request():
        result["r"] = httpx.post(url + "/generate", json={"inputs": "Hello", "parameters": {
            "max_new_tokens": 400}}, timeout=60)
    thread = threading.Thread(target=request)
    thread.start()
    deadline = time.monotonic() + 60
    while batch_size(url) < 1 and time.monotonic() < deadline:  # until it is generating
        time.sleep(0.05)
    os.kill(ranks[1], signal.SIGKILL)
    killed = time.monotonic()
    thread.join(30)
    assert time.monotonic() - killed < 5.0
    assert result["r"].status_code in (424, 503) and "error" in result["r"].json()
    assert httpx.get(url + "/health", timeout=5).status_code == 503
    # Rank 0 itself (alive, in the launcher's 503 grace) fails a check that needs
    # its peer from the dead peer's closed connection, not the collective's timeout.
    os.kill(ranks[0], 0)  # alive
    start = time.monotonic()
    with pytest.raises(ShardError) as err:
        rank_0_health(tmp)
    assert err.value.code is StatusCode.UNAVAILABLE and time.monotonic() - start < COLLECTIVE_TIMEOUT_S / 2
