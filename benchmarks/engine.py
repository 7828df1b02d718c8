"""Engine benchmark: the shard over its socket against transformers `generate`.

SmolLM2-135M-Instruct (its GGUF file, as the server's default) on 2
threads, in the dtype the shard chooses on this CPU (bf16 where the CPU
computes it natively, float32 elsewhere: machine.serving_dtype). The shard
runs in its own process (as in production), started without --dtype, and is
driven by the router's scheduler; the baseline runs `generate` on the
dequantized file in the same dtype, one request at a time (and, for
reference, as one static batch of 32) in this process while the shard
idles. Throughput is generated tokens over wall time. The ratio keys
compare the engine's decode throughput (steps in which no prompt is
prefilling) with `generate` one request at a time (its 128-token prefill is
~2% of its time); the `_e2e_` keys compare end-to-end throughput, the
engine's prefill of every prompt included.

Two shards take turns at each batch size: one eager (the `engine_b*` keys)
and one started as the launcher starts them, with decode sizes that the CPU
compiles (`engine_compiled_b*_decode_tok_s`; `engine_compiled_vs_eager_b*`,
the decode throughput of the compiled shard over the eager one's).
TGI_CPU_COMPILE is set for each, whatever the caller's environment says."""

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tgi_proto import pb
from tgi_router.scheduling.block_manager import BlockManager
from tgi_router.scheduling.client import ShardClient
from tgi_router.scheduling.engine import Engine
from tgi_router.scheduling.scheduler import Scheduler
from tgi_router.scheduling.sequence import Sequence, StoppingCriteria

from .machine import dtype_name, serving_dtype

THREADS = 2
PROMPT_TOKENS = 128
NEW_TOKENS = 128
BATCHES = (1, 8, 32, 64)
COMPILED_SIZES = (1, 2, 4, 8, 16, 32, 64)  # the shard's default --cuda-graphs on CPUs
HF_SEQUENTIAL_PROMPTS = 4
# The machines are shared and noisy: both sides report the best of repeated
# runs (the baseline its best prompt of HF_SEQUENTIAL_PROMPTS, the engine its
# best of REPEATS runs per batch size).
REPEATS = 2
TEXT = ("The history of computing spans centuries, from the abacus to mechanical calculators, "
        "from punched cards to vacuum tubes, transistors and integrated circuits. Each step made "
        "machines smaller, faster and cheaper, and each opened new uses: weather forecasts, "
        "banking, space flight, medicine, music and the web. ")


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    """n distinct prompts of PROMPT_TOKENS tokens (rotations of one text)."""
    ids = tokenizer(TEXT * 8)["input_ids"]
    return [(ids[i * 7:] + ids)[:PROMPT_TOKENS] for i in range(n)]


def hf_model(dtype: torch.dtype):
    """(transformers model of the default model's GGUF file dequantized, in dtype; tokenizer; file path)."""
    from tgi_server.quant.quantizer import load_float_model
    from tgi_server.weights.resolve import default_model_path

    model, tokenizer = load_float_model(None)
    return model.to(dtype), tokenizer, default_model_path()


def hf_throughput(model, prompts: list[list[int]]) -> float:
    """Tokens/s of `generate` over the prompts as one static batch."""
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) * len(prompts) / elapsed


@dataclass(frozen=True)
class BatchTimes:
    """One batch run dry by the router's scheduler and engine."""
    elapsed: float                 # seconds, first step to last
    generated: int                 # tokens generated
    decode_time: float             # seconds in steps where no prompt was prefilling
    decode_tokens: int             # tokens those steps generated
    first_token: list[float]       # seconds from the start to each sequence's first token, sorted
    outputs: list[list[int]]       # each prompt's generated tokens
    shard_ms: dict[str, float]     # the shard's own medians per step: prepare, forward, sample, total


class _TimedClient:
    """A ShardClient that keeps every step answer's timings (the shard's own clock)."""

    def __init__(self, client: ShardClient):
        self._client = client
        self.timings: list[pb.Timings] = []

    async def step(self, request: pb.StepRequest) -> pb.StepResponse:
        response = await self._client.step(request)
        self.timings.append(response.timings)
        return response

    def __getattr__(self, name: str):
        return getattr(self._client, name)


def _median_ms(timings: list[pb.Timings]) -> dict[str, float]:
    def median(values: list[int]) -> float:
        return round(sorted(values)[len(values) // 2] / 1e6, 3) if values else 0.0

    return {part: median([getattr(t, f"{part}_ns") for t in timings])
            for part in ("prepare", "forward", "sample", "total")}


async def run_batch(client: ShardClient, warm: pb.WarmupResponse, prompts: list[list[int]], new_tokens: int,
                    max_batch_tokens: int, adapters: list[int] | None = None,
                    plan_ahead: bool = True) -> BatchTimes:
    """All prompts at once, `new_tokens` greedy tokens each, through Engine.step as the router runs it
    (adapters[i]: prompt i's LoRA adapter; 0 or None: the base model; plan_ahead: async scheduling)."""
    scheduler = Scheduler(BlockManager(warm.num_blocks, warm.block_size), max_batch_tokens=max_batch_tokens)
    timed = _TimedClient(client)
    engine = Engine(timed, scheduler, plan_ahead=plan_ahead)
    seqs = [Sequence(id=i + 1, token_ids=list(p), params=pb.SamplingParameters(),
                     stopping=StoppingCriteria(new_tokens), adapter=adapters[i] if adapters else 0)
            for i, p in enumerate(prompts)]
    for s in seqs:
        scheduler.add(s)
    first: dict[int, float] = {}
    decode_time, decode_tokens = 0.0, 0
    start = time.perf_counter()
    while not engine.idle:
        prefilling = bool(scheduler.waiting) or any(s.num_computed < s.prompt_length for s in scheduler.running)
        batch = len(scheduler.running)
        t = time.perf_counter()
        await engine.step()
        now = time.perf_counter()
        if not prefilling:
            decode_time += now - t
            decode_tokens += batch
        for s in seqs:
            if s.id not in first and s.generated_ids:
                first[s.id] = now - start
    elapsed = time.perf_counter() - start
    await client.clear_cache()  # the finished ids are released on the shard
    return BatchTimes(elapsed, sum(len(s.generated_ids) for s in seqs), decode_time, decode_tokens,
                      sorted(first.values()), [list(s.generated_ids) for s in seqs], _median_ms(timed.timings))


async def engine_throughput(client: ShardClient, warm: pb.WarmupResponse,
                            prompts: list[list[int]]) -> tuple[float, float]:
    """(end-to-end tokens/s, decode-only tokens/s) for all prompts at once."""
    times = await run_batch(client, warm, prompts, NEW_TOKENS, max_batch_tokens=4096)
    return times.generated / times.elapsed, times.decode_tokens / max(times.decode_time, 1e-9)


def start_shard(model_path: Path, socket_dir: str, compiled: bool = False, governor: bool = True) -> subprocess.Popen:
    """The shard in its own process, in the dtype it chooses itself (serving_dtype);
    compiled: with the launcher's decode sizes (and 64), which the CPU compiles;
    governor False: its thread count fixed (TGI_THREAD_GOVERNOR=0)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), TGI_CPU_COMPILE="1" if compiled else "0",
               TGI_THREAD_GOVERNOR="1" if governor else "0")
    sizes = ("--cuda-graphs", ",".join(map(str, COMPILED_SIZES))) if compiled else ()
    return subprocess.Popen(
        [sys.executable, "-m", "tgi_server.cli", "serve", str(model_path), "--uds-path",
         f"{socket_dir}/shard", "--num-threads", str(THREADS), *sizes], env=env)


async def drive(sockets: dict[str, str], prompts: list[list[int]]) -> dict[str, dict[int, tuple[float, float]]]:
    """Per shard, per batch size: the best (tokens/s, decode tokens/s) of REPEATS;
    the shards take turns at each size, so the host's drift reaches both alike."""
    clients = {name: ShardClient([socket], timeout=600) for name, socket in sockets.items()}
    try:
        warm = {}
        for name, client in clients.items():
            await client.wait_ready(180)
            warm[name] = await client.warmup(4096, max(BATCHES), kv_cache_bytes=1 << 30)
            await engine_throughput(client, warm[name], prompts[:2])  # first-call costs out of the way
        runs: dict[str, dict[int, list]] = {name: {b: [] for b in BATCHES} for name in clients}
        for b in BATCHES:
            for _ in range(REPEATS):
                for name, client in clients.items():
                    runs[name][b].append(await engine_throughput(client, warm[name], prompts[:b]))
        return {name: {b: (max(r[0] for r in rs), max(r[1] for r in rs)) for b, rs in per.items()}
                for name, per in runs.items()}
    finally:
        for client in clients.values():
            await client.close()


def run() -> dict:
    torch.set_num_threads(THREADS)
    model, tokenizer, path = hf_model(serving_dtype())
    prompts = make_prompts(tokenizer, max(BATCHES))
    hf_throughput(model, prompts[:1])  # warm up
    hf_b1 = max(hf_throughput(model, [p]) for p in prompts[:HF_SEQUENTIAL_PROMPTS])
    hf_b32 = max(hf_throughput(model, prompts[:32]) for _ in range(REPEATS))
    del model
    with tempfile.TemporaryDirectory() as tmp:
        os.mkdir(f"{tmp}/eager")
        os.mkdir(f"{tmp}/compiled")
        # Threads fixed: each shard's governor would count the other's turn as
        # a busy core and start its own turn on one thread.
        shards = [start_shard(path, f"{tmp}/eager", governor=False),
                  start_shard(path, f"{tmp}/compiled", compiled=True, governor=False)]
        try:
            both = asyncio.run(drive({"eager": f"{tmp}/eager/shard-0", "compiled": f"{tmp}/compiled/shard-0"},
                                     prompts))
        finally:
            for shard in shards:
                shard.terminate()
                shard.wait(30)
    results, compiled = both["eager"], both["compiled"]
    print(f"\nEngine benchmark: SmolLM2-135M {dtype_name(serving_dtype())}, {THREADS} threads, "
          f"prompts {PROMPT_TOKENS} tokens, {NEW_TOKENS} new tokens")
    print(f"{'':<28}{'tok/s':>10}{'decode tok/s':>14}{'decode vs HF seq':>18}")
    print(f"{'transformers, sequential':<28}{hf_b1:>10.1f}{'':>14}{1.0:>18.2f}")
    print(f"{'transformers, static b32':<28}{hf_b32:>10.1f}{'':>14}{hf_b32 / hf_b1:>18.2f}")
    for b, (tps, dps) in results.items():
        print(f"{'engine, batch ' + str(b):<28}{tps:>10.1f}{dps:>14.1f}{dps / hf_b1:>18.2f}")
    for b, (tps, dps) in compiled.items():
        print(f"{'compiled, batch ' + str(b):<28}{tps:>10.1f}{dps:>14.1f}{dps / hf_b1:>18.2f}")
    out = {"hf_sequential_tok_s": round(hf_b1, 1), "hf_static_b32_tok_s": round(hf_b32, 1)}
    for b, (tps, dps) in results.items():
        out[f"engine_b{b}_tok_s"] = round(tps, 1)
        out[f"engine_b{b}_decode_tok_s"] = round(dps, 1)
    out["engine_b32_vs_hf_sequential"] = round(results[32][1] / hf_b1, 2)
    out["engine_b1_vs_hf_b1"] = round(results[1][1] / hf_b1, 2)
    out["engine_b32_e2e_vs_hf_sequential"] = round(results[32][0] / hf_b1, 2)
    out["engine_b1_e2e_vs_hf_b1"] = round(results[1][0] / hf_b1, 2)
    for b, (_, dps) in compiled.items():  # decode steps compiled, as the launcher's shards run them
        out[f"engine_compiled_b{b}_decode_tok_s"] = round(dps, 1)
        out[f"engine_compiled_vs_eager_b{b}"] = round(dps / results[b][1], 3)
    return out
