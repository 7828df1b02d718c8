"""Layer-level checks of what the HF comparisons (run in float32) do not
reach: the prepacked bf16 linear path and RoPE scaling types."""

import asyncio

import pytest
import torch
from torch.nn import functional as F

from tgi_server.layers.linear import Linear

from ..shard_harness import HF_CLASSES, InProcessShard, hf_greedy, run_prompts, save_tiny_model


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_matches_plain_matmul(rows, bias):
    torch.manual_seed(rows)
    w = torch.randn(96, 48, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, 48, dtype=torch.bfloat16)
    layer = Linear(w.clone(), None if b is None else b.clone())
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert (layer(x).float() - expected).abs().max().item() < 0.1 * expected.abs().max().item() / 8


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_scaling_types_match_transformers(tmp_path, rope):
    path = save_tiny_model("llama", tmp_path / "m", rope_parameters={"rope_theta": 10000.0, **rope})
    hf = HF_CLASSES["llama"][1].from_pretrained(path, dtype=torch.float32).eval()
    prompt = list(range(5, 90))
    with InProcessShard(tmp_path, str(path)) as shard:
        (seq,) = asyncio.run(run_prompts(shard.socket, [prompt], 24))
    assert seq.generated_ids == hf_greedy(hf, prompt, 24)
