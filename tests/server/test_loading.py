"""Model resolution and load errors: one line on stderr, non-zero exit."""

import asyncio
import os
import shutil
import subprocess
import sys
import time

import pytest

from tgi_router.scheduling.client import ShardClient
from tgi_server.weights.errors import CheckpointError
from tgi_server.weights.resolve import resolve_model

from ..shard_harness import save_tiny_model


def serve(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "tgi_server.cli", "serve", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def assert_one_line_error(result, *needles):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0]


def test_missing_path_is_one_line_error(tmp_path):
    assert_one_line_error(serve(str(tmp_path / "nope"), "--uds-path", str(tmp_path / "s")), "does not exist")


def test_unsupported_architecture_names_supported_ones(tmp_path):
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "g")
    assert_one_line_error(serve(str(tmp_path / "g"), "--uds-path", str(tmp_path / "s")),
                          "gpt2", "llama, mistral, qwen2")


def test_corrupt_safetensors_is_one_line_error(tmp_path):
    path = save_tiny_model("llama", tmp_path / "m")
    (path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    assert_one_line_error(serve(str(path), "--uds-path", str(tmp_path / "s")), "model.safetensors")


def test_hub_id_loads_from_local_cache_without_network(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / "abc123"
    save_tiny_model("llama", snapshot)
    (tmp_path / "hub" / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    source = resolve_model("tiny-org/tiny-llama")
    assert source.format == "safetensors" and source.path == snapshot
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache"):
        resolve_model("tiny-org/absent")


def test_sharded_safetensors_index_loads(tmp_path):
    import torch
    import transformers

    from tgi_server.distributed import TensorParallel
    from tgi_server.model_loader import load_model, open_checkpoint

    path = save_tiny_model("llama", tmp_path / "m")
    model = transformers.LlamaForCausalLM.from_pretrained(path)
    shutil.rmtree(path)
    model.save_pretrained(path, max_shard_size="50KB")
    assert (path / "model.safetensors.index.json").exists()
    config, weights = open_checkpoint(resolve_model(str(path)), torch.float32, torch.device("cpu"))
    loaded = load_model(config, weights, TensorParallel())
    assert loaded.config.num_layers == 2


@pytest.mark.slow
def test_default_model_serves_over_a_unix_socket(tmp_path):
    """`text-generation-server serve` with no model: SmolLM2 from the GGUF."""
    uds = str(tmp_path / "shard")
    proc = subprocess.Popen([sys.executable, "-m", "tgi_server.cli", "serve", "--uds-path", uds,
                             "--num-threads", "1"], env=dict(os.environ), stderr=subprocess.PIPE, text=True)

    async def info():
        client = ShardClient([uds + "-0"], timeout=10)
        try:
            await client.wait_ready(120)
            return await client.info()
        finally:
            await client.close()
    try:
        deadline = time.time() + 120
        while not os.path.exists(uds + "-0") and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        result = asyncio.run(info())
        assert result.model_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert (result.num_layers, result.vocab_size, result.num_kv_heads) == (30, 49152, 3)
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    assert not os.path.exists(uds + "-0")
