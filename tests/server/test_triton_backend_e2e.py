"""The engine end to end with the Triton attention backend forced (on CPU:
Triton's interpreter): greedy tokens identical to the torch (sdpa) backend."""

import asyncio

import pytest
import torch

from ..shard_harness import InProcessShard, run_prompts, save_tiny_model
from ..triton_interpreter import use_triton_interpreter

PROMPTS = [[5], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], list(range(30, 70))]


def generate(tmp_path, path, backend: str) -> tuple[list[list[int]], str]:
    with InProcessShard(tmp_path / backend, str(path), backend=backend) as shard:
        # A 16-token budget chunks the longer prompts: later chunks read a cached prefix.
        seqs = asyncio.run(run_prompts(shard.socket, PROMPTS, 8, max_batch_tokens=16, warmup_tokens=32))
        return [s.generated_ids for s in seqs], shard.info.attention_backend


@pytest.mark.slow
@pytest.mark.skipif(not use_triton_interpreter() or torch.cuda.is_available(),
                    reason="needs triton; on a GPU machine the gpu tests run the kernels compiled instead")
def test_greedy_tokens_with_forced_triton_match_the_torch_backend(tmp_path):
    path = save_tiny_model("llama", tmp_path / "llama", seed=3)
    (tmp_path / "triton").mkdir()
    (tmp_path / "sdpa").mkdir()
    triton_tokens, reported = generate(tmp_path, path, "triton")
    sdpa_tokens, _ = generate(tmp_path, path, "sdpa")
    assert reported == "triton"
    assert all(len(t) == 8 for t in triton_tokens)
    assert triton_tokens == sdpa_tokens
