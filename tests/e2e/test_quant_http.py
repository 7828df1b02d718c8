"""Quantized serving through the real launcher, as a user runs it: a GPTQ
checkpoint written by `text-generation-server quantize` gives the same greedy
text over HTTP on two shards as on one, EETQ quantizes a float checkpoint at
load, and a --quantize method we do not serve is refused before any shard starts."""

import re
import subprocess
import sys

import httpx
import pytest

from tgi_server.cli import main as server_cli

from ..shard_harness import save_tiny_served_model
from .router_harness import free_port, launch, wait_launched
from .test_tensor_parallel_http import PROMPTS, answers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    """8 attention heads and 4 KV heads (4 + 2 per rank at N=2), hidden 64: groups of 32."""
    path = tmp_path_factory.mktemp("quant") / "float"
    return save_tiny_served_model(path, eos_token_id=None, num_attention_heads=8, num_key_value_heads=4)


@pytest.fixture(scope="module")
def gptq_model(float_model):
    out = float_model.parent / "gptq"
    server_cli(["quantize", str(float_model), str(out), "--method", "gptq", "--group-size", "32", "--act-order",
                "--samples", "4", "--seq-len", "32"])
    return str(out)


def test_gptq_on_two_shards_answers_as_one_shard(gptq_model, tmp_path):
    # float32: the quantized layers' packed kernels, and partial sums close enough for seeded draws.
    # Both launches load at once; each is then asked one request at a time (see `answers`).
    launches = [launch(gptq_model, tmp_path / f"n{n}", "--num-shard", str(n), "--master-port", str(free_port()),
                       "--quantize", "gptq", "--dtype", "float32", wait=False) for n in (1, 2)]
    try:
        for n, (proc, url) in zip((1, 2), launches):
            wait_launched(proc, url, tmp_path / f"n{n}")
        one, two = (answers(url) for _, url in launches)
    finally:
        for proc, _ in launches:
            proc.terminate()
            proc.wait(30)
    assert two == one
    assert all(text for text in one[0])  # 16 greedy tokens each, never an empty answer


def test_eetq_quantizes_a_float_checkpoint_at_load_and_serves(float_model, tmp_path):
    proc, url = launch(str(float_model), tmp_path, "--quantize", "eetq")
    try:
        for prompt in PROMPTS[:3]:
            response = httpx.post(url + "/generate", timeout=120, json={
                "inputs": prompt, "parameters": {"max_new_tokens": 8, "details": True}})
            assert response.status_code == 200
            assert response.json()["details"]["generated_tokens"] == 8
    finally:
        proc.terminate()
        proc.wait(30)
    (line,) = [line for line in (tmp_path / "launcher.log").read_text().splitlines()
               if "quantized linears by kernel:" in line]
    assert re.search(r"by kernel: \d+ int8 ", line)  # per-channel int8 in every linear, no other kernel


def test_a_method_we_do_not_serve_is_refused_in_one_line(float_model):
    done = subprocess.run([sys.executable, "-m", "tgi_router.launch.launcher", "--model-id", str(float_model),
                           "--quantize", "bitsandbytes"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2  # a usage error, as for any bad flag
    assert "--quantize bitsandbytes is not supported (supported: awq, eetq, gptq)" in done.stderr + done.stdout
