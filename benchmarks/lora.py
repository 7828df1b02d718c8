"""LoRA benchmark: 32 streams of the default model (SmolLM2-135M-Instruct,
its Q4_1 GGUF as served) with four adapters mixed in one batch, against
the same 32 streams on the base model alone, on one shard that has the
four loaded (so the comparison isolates what serving the adapters costs).

The adapters are random PEFT LoRAs of rank 16 on every linear of every
layer (q, k, v, o, gate, up, down), built once with peft on the
dequantized model and saved to a temporary directory. The shard runs in its
own process on 2 threads, driven by the router's scheduler (engine
benchmark), prompts of 128 tokens and 128 new tokens; base and mixed runs
alternate, each keeping its best of REPEATS (the machines are noisy).
`lora_c32_mixed_vs_base` is the mixed run's decode throughput over the
base's (the goal: >= 0.7)."""

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from tgi_router.scheduling.client import ShardClient

from .engine import NEW_TOKENS, THREADS, hf_model, make_prompts, run_batch
from .machine import dtype_name, serving_dtype

ADAPTERS = 4
RANK = 16
STREAMS = 32
REPEATS = 3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapters(model, directory: Path) -> str:
    """ADAPTERS random adapters under `directory`; their --lora-adapters list."""
    specs = []
    for i in range(ADAPTERS):
        peft_model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS,
                                                      init_lora_weights=False))
        torch.manual_seed(i)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.02)
        peft_model.save_pretrained(directory / f"a{i}")
        model = peft_model.unload()
        specs.append(f"a{i}={directory / f'a{i}'}")
    return ",".join(specs)


async def drive(socket: str, prompts: list[list[int]]) -> dict[str, tuple[float, float]]:
    client = ShardClient([socket], timeout=600)
    try:
        await client.wait_ready(180)
        warm = await client.warmup(4096, STREAMS, kv_cache_bytes=1 << 30)
        mixes = {"base": [0] * STREAMS, "mixed": [1 + i % ADAPTERS for i in range(STREAMS)]}
        await run_batch(client, warm, prompts[:2], 8, 4096, [0, 1])  # first-call costs out of the way
        best = {name: (0.0, 0.0) for name in mixes}
        for _ in range(REPEATS):
            for name, adapters in mixes.items():
                t = await run_batch(client, warm, prompts, NEW_TOKENS, 4096, adapters)
                e2e, decode = t.generated / t.elapsed, t.decode_tokens / max(t.decode_time, 1e-9)
                best[name] = (max(best[name][0], e2e), max(best[name][1], decode))
        return best
    finally:
        await client.close()


def run() -> dict:
    torch.set_num_threads(THREADS)
    model, tokenizer, path = hf_model(torch.float32)
    prompts = make_prompts(tokenizer, STREAMS)
    with tempfile.TemporaryDirectory() as tmp:
        spec = save_adapters(model, Path(tmp))
        del model
        env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
        shard = subprocess.Popen([sys.executable, "-m", "tgi_server.cli", "serve", str(path), "--uds-path",
                                  f"{tmp}/shard", "--num-threads", str(THREADS), "--lora-adapters", spec], env=env)
        try:
            best = asyncio.run(drive(f"{tmp}/shard-0", prompts))
        finally:
            shard.terminate()
            shard.wait(60)
    (base_e2e, base_decode), (mixed_e2e, mixed_decode) = best["base"], best["mixed"]
    print(f"lora: c={STREAMS}, {ADAPTERS} adapters of rank {RANK} on every linear: base {base_decode:.1f} tok/s "
          f"decoding ({base_e2e:.1f} end to end), mixed {mixed_decode:.1f} ({mixed_e2e:.1f})", flush=True)
    return {"lora_c32_base_tok_s": round(base_decode, 1), "lora_c32_mixed_tok_s": round(mixed_decode, 1),
            "lora_c32_mixed_vs_base": round(mixed_decode / base_decode, 3),
            "lora_c32_e2e_mixed_vs_base": round(mixed_e2e / base_e2e, 3), "lora_dtype": dtype_name(serving_dtype())}
