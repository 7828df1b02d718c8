"""--num-shard N through the real launcher: N shard processes joined by gloo
give the same text over HTTP as one shard, and a rank that dies fails the
requests in flight and turns /health to 503."""

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ..shard_harness import save_tiny_served_model
from .router_harness import free_port, launch

PROMPTS = ["Hello", "The weather today", "Once upon a time", "1, 2, 3,", "Paris is",
           "Write a poem", "def main():", "The quick brown fox"]


GREEDY = {"max_new_tokens": 16}
SEEDED = {"max_new_tokens": 16, "do_sample": True, "temperature": 0.8, "seed": 7}


def generated(url: str, prompt: str, parameters: dict) -> str:
    return httpx.post(url + "/generate", json={"inputs": prompt, "parameters": parameters},
                      timeout=120).json()["generated_text"]


def answers(model: str | None, tmp_path, num_shard: int, *flags: str,
            concurrent: bool = False) -> tuple[list[str], list[str]]:
    """(greedy texts, seeded sampled texts) of PROMPTS from a launch with
    `num_shard` shards. concurrent: all 16 requests are sent at once and
    share batches, whose make-up then varies with arrival order (only in
    float64 is a text then independent of it); else one at a time."""
    proc, url = launch(model, tmp_path / f"n{num_shard}", "--num-shard", str(num_shard),
                       "--master-port", str(free_port()), *flags)
    requests = [(p, GREEDY) for p in PROMPTS] + [(p, SEEDED) for p in PROMPTS]
    try:
        if concurrent:
            with ThreadPoolExecutor(len(requests)) as pool:
                texts = list(pool.map(lambda request: generated(url, *request), requests))
        else:
            texts = [generated(url, *request) for request in requests]
        return texts[:len(PROMPTS)], texts[len(PROMPTS):]
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """8 attention heads, 4 KV heads: 4 + 2 per rank at N=2."""
    path = tmp_path_factory.mktemp("tp") / "tiny"
    return str(save_tiny_served_model(path, eos_token_id=None, num_attention_heads=8, num_key_value_heads=4))


def test_two_shards_answer_as_one(tiny, tmp_path):
    """float32: in bf16 (the default on this CPU) the ranks' partial sums round
    differently from one GEMM's, enough to move a seeded draw from the random
    model's nearly flat distribution."""
    (tmp_path / "n1").mkdir()
    (tmp_path / "n2").mkdir()
    assert answers(tiny, tmp_path, 2, "--dtype", "float32") == answers(tiny, tmp_path, 1, "--dtype", "float32")


@pytest.mark.slow
def test_smollm2_on_three_shards_answers_as_one(tmp_path):
    """9 heads and 3 KV heads: 3 + 1 per rank. float64 on both sides: in
    float32 the ranks' partial sums (added in another order than one GEMM's)
    moved prompt logprobs by up to 2.3e-5, and that once put a seeded draw on
    the other side of a boundary of SmolLM2's distribution (1 prompt in 8)."""
    (tmp_path / "n1").mkdir()
    (tmp_path / "n3").mkdir()
    # A 64-token warmup: float64 GEMMs are slow, warmup prefills the whole budget, and the
    # 8 prompts (at most 6 tokens each) fit in one such step.
    flags = ("--dtype", "float64", "--kv-cache-bytes", "160MiB", "--max-input-tokens", "32",
             "--max-total-tokens", "64", "--max-batch-prefill-tokens", "64")
    assert answers(None, tmp_path, 3, *flags, concurrent=True) == answers(None, tmp_path, 1, *flags, concurrent=True)


def test_a_dead_rank_fails_in_flight_requests_and_health(tiny, tmp_path):
    proc, url = launch(tiny, tmp_path, "--num-shard", "2", "--master-port", str(free_port()))
    try:
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(ranks) == 2
        result = {}

        def request():
            result["r"] = httpx.post(url + "/generate", json={"inputs": "Hello", "parameters": {
                "max_new_tokens": 400}}, timeout=60)
        thread = threading.Thread(target=request)
        thread.start()
        time.sleep(1.0)  # generating
        os.kill(int(max(ranks, key=int)), signal.SIGKILL)
        killed = time.monotonic()
        thread.join(30)
        assert time.monotonic() - killed < 5.0
        assert result["r"].status_code in (424, 503) and "error" in result["r"].json()
        assert httpx.get(url + "/health", timeout=5).status_code == 503
    finally:
        proc.kill()
        proc.wait(30)
