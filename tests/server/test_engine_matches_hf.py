"""Greedy decoding through the shard over gRPC matches transformers'
`generate` on the same weights (float32), and prefill logits agree."""

import asyncio

import pytest
import torch

from tgi_server.batch import build_batch
from tgi_server.sequences import ShardSequence

from ..conftest import SMOLLM2_GREEDY_TOKENS
from ..shard_harness import HF_CLASSES, InProcessShard, hf_greedy, run_prompts, save_tiny_model, torch_threads

PROMPTS = [[1, 17, 33, 91, 5], [1, 200, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
           [1, 64], list(range(1, 40))]
NEW_TOKENS = 48


@pytest.fixture(autouse=True)
def _one_thread():
    """transformers and the in-process shard on one torch thread: beside other
    processes' work two OpenMP threads wait on each other in every op
    (shard_harness.torch_threads; no result depends on the count)."""
    with torch_threads(1):
        yield


def engine_logits(runner, prompt: list[int]) -> torch.Tensor:
    """Prefill logits [len(prompt), vocab] from our model for one sequence."""
    seq = ShardSequence(id=1, token_ids=list(prompt), prompt_length=len(prompt), num_computed=0,
                        block_table=list(range(-(-len(prompt) // runner.block_size))), params=None,
                        prefill_logprobs=True, scheduled=len(prompt))
    batch = build_batch([seq], runner.block_size, runner.device)
    ctx = runner.context(batch)
    with torch.inference_mode():
        hidden = runner.model(batch.input_ids, ctx)
        return runner.model.logits(hidden, batch.logits_rows)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "smollm3", "gemma2", "gemma3_text",
                                        "phi3", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_tiny_models_match_transformers(tmp_path, model_type):
    path = save_tiny_model(model_type, tmp_path / model_type)
    hf = HF_CLASSES[model_type][1].from_pretrained(path, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    with InProcessShard(tmp_path, str(path)) as shard:
        seqs = asyncio.run(run_prompts(shard.socket, PROMPTS, NEW_TOKENS))
        for prompt in PROMPTS:
            ours = engine_logits(shard.runner, prompt)
            with torch.no_grad():
                theirs = hf(torch.tensor([prompt])).logits[0]
            assert (ours - theirs).abs().max().item() < 1e-4
    assert [s.generated_ids for s in seqs] == expected


def test_mistral_sliding_window_is_exercised(tmp_path):
    """Prompts longer than the tiny mistral's 24-token window still match."""
    path = save_tiny_model("mistral", tmp_path / "m", seed=3)
    hf = HF_CLASSES["mistral"][1].from_pretrained(path, dtype=torch.float32).eval()
    prompt = list(range(3, 60))
    with InProcessShard(tmp_path, str(path)) as shard:
        seqs = asyncio.run(run_prompts(shard.socket, [prompt], 30))
        ours = engine_logits(shard.runner, prompt)
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4
    assert seqs[0].generated_ids == hf_greedy(hf, prompt, 30)


@pytest.mark.slow
def test_smollm2_matches_transformers(tmp_path, smollm2_hf, smollm2_greedy):
    """SmolLM2's file as served in float32, the four prompts decoded
    together. 32 new tokens (SMOLLM2_GREEDY_TOKENS; the prompts are 4-6
    tokens): each sequence crosses two 16-token KV blocks while decoding, and
    greedy text of a 135M model drifts away within a few tokens of a wrong
    logit. transformers' tokens come from the session's cache, which
    test_gguf shares."""
    hf, tokenizer, gguf_path = smollm2_hf
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
             "The three primary colors are"]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    expected = [smollm2_greedy(t, SMOLLM2_GREEDY_TOKENS) for t in texts]
    with InProcessShard(tmp_path, str(gguf_path), kv_cache_bytes=64 << 20) as shard:
        seqs = asyncio.run(run_prompts(shard.socket, prompts, SMOLLM2_GREEDY_TOKENS))
        ours = engine_logits(shard.runner, prompts[0])
    with torch.no_grad():
        theirs = hf(torch.tensor([prompts[0]])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4
    assert [len(s.generated_ids) for s in seqs] == [SMOLLM2_GREEDY_TOKENS] * 4
    assert [s.generated_ids for s in seqs] == expected
    assert "Paris" in tokenizer.decode(seqs[0].generated_ids)


def test_a_backend_that_cannot_cap_scores_is_refused_for_gemma2(tmp_path, monkeypatch):
    """triton has no soft cap: a shard forced onto it (on CUDA) for a gemma2
    model stops at load with one line naming the backends that can."""
    from tgi_server import model_runner
    from tgi_server.distributed import TensorParallel
    from tgi_server.model_loader import load_model, open_checkpoint
    from tgi_server.weights.resolve import resolve_model

    path = save_tiny_model("gemma2", tmp_path / "gemma2")
    config, weights = open_checkpoint(resolve_model(str(path)), torch.float32, torch.device("cpu"), None)
    monkeypatch.setattr(model_runner, "select_backend", lambda device, forced, fp8_kv: forced)  # as on CUDA
    with pytest.raises(ValueError, match="the triton attention backend cannot cap attention scores .* use one of "
                                         "reference, sdpa, cpu, flash_attn"):
        model_runner.ModelRunner(load_model(config, weights, TensorParallel()), 16, "triton", 1 << 20)
