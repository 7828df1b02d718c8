"""MoE benchmark: a random qwen3_moe of ~0.5B parameters (8 experts, top 2)
served by the shard against transformers `generate` on the same weights.

The model: hidden 1024, 12 layers of 16 query and 4 key-value heads, every
MLP a mixture of 8 experts of intermediate size 1536, top 2 renormalized
(~0.52B parameters, ~0.18B of them active a token), random weights saved
once under a temporary directory, in the dtype the shard chooses on this CPU
(machine.serving_dtype). As in the engine benchmark, the shard runs in its
own process driven by the router's scheduler, and `generate` runs one prompt
at a time in this process while the shard idles; both on 2 threads. Then a
decode step at batch 32 is profiled in process (torch profiler): where its
time goes, by op."""

import asyncio
import tempfile
from pathlib import Path

import torch
import transformers

from tgi_proto import pb
from tgi_router.scheduling.client import ShardClient
from tgi_server.distributed import TensorParallel
from tgi_server.model_loader import load_model, open_checkpoint
from tgi_server.model_runner import ModelRunner
from tgi_server.weights.resolve import resolve_model

from . import engine as engine_bench
from .machine import CPU, dtype_name, serving_dtype

BATCHES = (1, 32)
PROMPT_TOKENS = 128
CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=1536, moe_intermediate_size=1536,
              num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
              num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=2048,
              tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=1, eos_token_id=2)
PROFILED_STEPS = 4


def save_model(path: Path, dtype: torch.dtype) -> transformers.PreTrainedModel:
    config = transformers.Qwen3MoeConfig(**CONFIG)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to(dtype).eval()
    model.save_pretrained(path)
    return model


def prompts(n: int) -> list[list[int]]:
    """n distinct prompts of PROMPT_TOKENS random ids (routing differs per token)."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, CONFIG["vocab_size"], (n, PROMPT_TOKENS), generator=g).tolist()


async def drive(socket: str, batch_prompts: list[list[int]]) -> dict[int, tuple[float, float]]:
    client = ShardClient([socket], timeout=600)
    try:
        await client.wait_ready(300)
        warm = await client.warmup(4096, max(BATCHES), kv_cache_bytes=1 << 30)
        await engine_bench.engine_throughput(client, warm, batch_prompts[:2])  # first-call costs out of the way
        results = {}
        for b in BATCHES:
            runs = [await engine_bench.engine_throughput(client, warm, batch_prompts[:b])
                    for _ in range(engine_bench.REPEATS)]
            results[b] = (max(r[0] for r in runs), max(r[1] for r in runs))
        return results
    finally:
        await client.close()


def profile_decode(path: Path, dtype: torch.dtype, batch_prompts: list[list[int]]) -> str:
    """The torch profiler's table of PROFILED_STEPS decode steps at batch 32."""
    config, weights = open_checkpoint(resolve_model(str(path)), dtype, CPU)
    runner = ModelRunner(load_model(config, weights, TensorParallel()), 16, attention_backend=None,
                         kv_cache_bytes=256 << 20)
    runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=len(batch_prompts) * PROMPT_TOKENS,
                                   max_batch_size=len(batch_prompts)))
    blocks = -(-(PROMPT_TOKENS + 2 * PROFILED_STEPS + 2) // 16)
    new = [pb.NewSequence(id=i + 1, token_ids=p, prompt_length=len(p), num_scheduled_tokens=len(p),
                          block_table=list(range(i * blocks, (i + 1) * blocks)), parameters=pb.SamplingParameters())
           for i, p in enumerate(batch_prompts)]
    runner.step(pb.StepRequest(step_id=0, new_sequences=new))
    ids = [s.id for s in new]

    def decode(step_id: int) -> None:
        runner.step(pb.StepRequest(step_id=step_id, running=[pb.RunningSequence(id=i, num_scheduled_tokens=1)
                                                             for i in ids]))
    decode(1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for step in range(PROFILED_STEPS):
            decode(step + 2)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


def run() -> dict:
    torch.set_num_threads(engine_bench.THREADS)
    dtype = serving_dtype()
    batch_prompts = prompts(max(BATCHES))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qwen3_moe"
        model = save_model(path, dtype)
        params = sum(p.numel() for p in model.parameters())
        engine_bench.hf_throughput(model, batch_prompts[:1])  # warm up
        hf_b1 = max(engine_bench.hf_throughput(model, [p]) for p in batch_prompts[:2])
        del model
        shard = engine_bench.start_shard(path, tmp)
        try:
            results = asyncio.run(drive(f"{tmp}/shard-0", batch_prompts))
        finally:
            shard.terminate()
            shard.wait(30)
        table = profile_decode(path, dtype, batch_prompts[:32])
    print(f"\nMoE benchmark: random qwen3_moe, {params / 1e9:.2f}B parameters (8 experts, top 2), "
          f"{dtype_name(dtype)}, {engine_bench.THREADS} threads, prompts {PROMPT_TOKENS} tokens, "
          f"{engine_bench.NEW_TOKENS} new tokens")
    print(f"{'':<28}{'tok/s':>10}{'decode tok/s':>14}{'decode vs HF seq':>18}")
    print(f"{'transformers, sequential':<28}{hf_b1:>10.1f}{'':>14}{1.0:>18.2f}")
    for b, (tps, dps) in results.items():
        print(f"{'engine, batch ' + str(b):<28}{tps:>10.1f}{dps:>14.1f}{dps / hf_b1:>18.2f}")
    print(f"\nA decode step at batch 32 ({PROFILED_STEPS} steps, in process):\n{table}")
    out = {"moe_params_b": round(params / 1e9, 3), "moe_hf_sequential_tok_s": round(hf_b1, 1)}
    for b, (tps, dps) in results.items():
        out[f"moe_b{b}_tok_s"] = round(tps, 1)
        out[f"moe_b{b}_decode_tok_s"] = round(dps, 1)
    out["moe_b32_vs_hf_sequential"] = round(results[32][1] / hf_b1, 2)
    out["moe_b1_vs_hf_b1"] = round(results[1][1] / hf_b1, 2)
    return out
