"""Quantization benchmark: SmolLM2-135M-Instruct served dense, EETQ (int8),
GPTQ 4-bit, AWQ 4-bit and GGUF Q4_1, all in this process on 2 threads.

Each variant is loaded by the shard's own loader as the shard loads it
without --dtype on this CPU (machine.serving_dtype: bf16 where the CPU has
it natively, else float32 with the quantized kernels fed bf16) and driven
through ModelRunner.step, the call behind a Step: BATCH prompts of
PROMPT_TOKENS tokens are prefilled, then DECODE_STEPS greedy decode steps
are timed. Reported per variant: weight bytes held and decode tokens/s at
batch 1 and 32 (best of REPEATS interleaved rounds: the machine is shared).
The dense baseline is the GGUF file dequantized once and saved as
safetensors. `int4_b1_vs_dense` is GPTQ-4bit's batch-1 decode speed over
the dense model's. Two more variants run the GGUF file with float32
activations, as a CPU without bf16 serves it: exact (--dtype float32) and
with the int4 kernel fed bf16 (the shard's default there);
`fp32_bf16_kernels_b1_vs_exact` is the second's batch-1 speed over the
first's. Quantized checkpoints are written once into CACHE (a few minutes each)."""

import tempfile
import time
from pathlib import Path

import torch

from tgi_proto import pb
from tgi_server.distributed import TensorParallel
from tgi_server.model_loader import default_quant_kernel_dtype, load_model, open_checkpoint
from tgi_server.model_runner import ModelRunner
from tgi_server.quant.quantizer import quantize_model, save_float_model
from tgi_server.weights.resolve import default_model_path, resolve_model

from .machine import CPU, dtype_name, serving_dtype

THREADS = 2
PROMPT_TOKENS = 32
DECODE_STEPS = 32
BATCHES = (1, 32)
REPEATS = 3
BLOCK = 16
CACHE = Path(tempfile.gettempdir()) / "tgi-py-bench-quant"


def checkpoints() -> dict[str, tuple[str, str | None, tuple[torch.dtype, torch.dtype | None]]]:
    """name -> (model path, --quantize, (dtype, quantized kernels' dtype)); quantizes what CACHE lacks."""
    dtype = serving_dtype()
    served = (dtype, default_quant_kernel_dtype(CPU, dtype))  # as the shard loads them without --dtype
    float_dir, gptq, awq = CACHE / "bf16", CACHE / "gptq-4bit", CACHE / "awq-4bit"
    if not (float_dir / "config.json").exists():
        save_float_model(None, float_dir)
    if not (gptq / "config.json").exists():
        quantize_model(None, gptq, "gptq", group_size=32, act_order=True)
    if not (awq / "config.json").exists():
        quantize_model(None, awq, "awq", group_size=32)
    gguf = str(default_model_path())
    return {"dense": (str(float_dir), None, (dtype, None)), "eetq": (str(float_dir), "eetq", served),
            "gptq_4bit": (str(gptq), None, served), "awq_4bit": (str(awq), None, served),
            "gguf_q4_1": (gguf, None, served),
            "q4_1_fp32": (gguf, None, (torch.float32, None)),
            "q4_1_fp32_bf16k": (gguf, None, (torch.float32, torch.bfloat16))}


def decode_tok_s(runner: ModelRunner, batch: int) -> float:
    """Greedy decode tokens/s of `batch` sequences after their prefill."""
    blocks = -(-(PROMPT_TOKENS + DECODE_STEPS + 1) // BLOCK)
    new = [pb.NewSequence(id=i + 1, token_ids=[(7 * i + j) % 5000 + 100 for j in range(PROMPT_TOKENS)],
                          prompt_length=PROMPT_TOKENS, num_scheduled_tokens=PROMPT_TOKENS,
                          block_table=list(range(i * blocks, (i + 1) * blocks)),
                          parameters=pb.SamplingParameters()) for i in range(batch)]
    last = {g.id: g.token_id for g in runner.step(pb.StepRequest(step_id=0, new_sequences=new)).generations}
    start = time.perf_counter()
    for step in range(DECODE_STEPS):
        running = [pb.RunningSequence(id=i, num_scheduled_tokens=1) for i in last]
        last = {g.id: g.token_id for g in runner.step(pb.StepRequest(step_id=step + 1, running=running)).generations}
    elapsed = time.perf_counter() - start
    runner.step(pb.StepRequest(step_id=DECODE_STEPS + 1, release_ids=list(last)))
    return batch * DECODE_STEPS / elapsed


def load(path: str, quantize: str | None, dtypes: tuple[torch.dtype, torch.dtype | None]) -> tuple[ModelRunner, int]:
    """(warmed-up runner, weight bytes) of one variant."""
    config, weights = open_checkpoint(resolve_model(path), dtypes[0], CPU, quantize, dtypes[1])
    loaded = load_model(config, weights, TensorParallel())
    runner = ModelRunner(loaded, BLOCK, attention_backend=None, kv_cache_bytes=256 << 20)
    runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=max(BATCHES) * PROMPT_TOKENS,
                                   max_batch_size=max(BATCHES)))
    for batch in BATCHES:
        decode_tok_s(runner, batch)  # first-call costs out of the way
    return runner, loaded.weight_bytes


def run() -> dict:
    torch.set_num_threads(THREADS)
    runners = {name: load(*variant) for name, variant in checkpoints().items()}
    results = {name: {"weight_mib": round(size / 2 ** 20, 1)} for name, (_, size) in runners.items()}
    # Rounds interleave the variants, so that a burst of load from other
    # processes on this shared machine does not land on one variant only.
    for _ in range(REPEATS):
        for name, (runner, _) in runners.items():
            for batch in BATCHES:
                key = f"b{batch}_tok_s"
                results[name][key] = round(max(results[name].get(key, 0.0), decode_tok_s(runner, batch)), 1)
    print(f"\nQuantization benchmark: SmolLM2-135M, {dtype_name(serving_dtype())} (the q4_1_fp32 rows: float32; "
          f"bf16k: the int4 kernel fed bf16), {THREADS} threads, "
          f"{PROMPT_TOKENS}-token prompts, {DECODE_STEPS} decode steps")
    print(f"{'':<16}{'weights MiB':>12}" + "".join(f"{f'b{b} tok/s':>12}" for b in BATCHES))
    for name, r in results.items():
        print(f"{name:<16}{r['weight_mib']:>12}" + "".join(f"{r[f'b{b}_tok_s']:>12}" for b in BATCHES))
    out = {f"quant_{name}_{key}": value for name, r in results.items() for key, value in r.items()}
    base = results["dense"]["b1_tok_s"]
    out["int4_b1_vs_dense"] = round(results["gptq_4bit"]["b1_tok_s"] / base, 2)
    out["awq_b1_vs_dense"] = round(results["awq_4bit"]["b1_tok_s"] / base, 2)
    out["gguf_q4_1_b1_vs_dense"] = round(results["gguf_q4_1"]["b1_tok_s"] / base, 2)
    out["eetq_b1_vs_dense"] = round(results["eetq"]["b1_tok_s"] / base, 2)
    out["fp32_bf16_kernels_b1_vs_exact"] = round(results["q4_1_fp32_bf16k"]["b1_tok_s"]
                                                 / results["q4_1_fp32"]["b1_tok_s"], 2)
    return out
