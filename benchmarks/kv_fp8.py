"""float8 KV cache benchmark (--kv-cache-dtype): the default model (the
SmolLM2-135M-Instruct Q4_1 GGUF, in the dtype the shard picks on this CPU)
with its KV blocks in that dtype, in fp8_e4m3fn and in fp8_e5m2.

- Through the real launcher with the same --kv-cache-bytes (64 MiB): the
  tokens the cache holds (/info's max_total_tokens: the Warmup's blocks,
  below the model's 8,192 positions), and the greedy tokens of five prompts
  (128 new tokens each, the five at once). The same float cache read by the
  sdpa backend instead of the default one gives the noise floor of that
  comparison: the serving dtype's rounding alone, in the same sitting.
- In-process, the model in float32: the same five prompts' greedy tokens
  and the perplexity below with each cache. In bf16 the noise floor alone
  changes most answers; in float32 two kernels' roundings give the same
  tokens, so what differs is float8's doing.
- In-process: perplexity of the quantization tests' fixed text (Python's
  LICENSE.txt, its first 2,000 tokens) fed one token a step, so that every
  key and value the model attends to is read back from the cache, as decode
  reads them; and the decode step of 32 sequences of ~400 tokens, each
  cache's runner timed in turn, six rounds (the host is noisy: the median
  round of each).

Why one token a step: a chunk's own keys and values are the step's fresh
ones, never rounded, and a token's nearest ones carry much of its
attention, so fed in chunks the model would hide much of float8's loss
(figures: docs/tuning.md#float8-kv-perplexity).
"""

import functools
import os
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from tests.shard_harness import chunked_logprobs
from tgi_proto import pb
from tgi_server.config import ShardConfig
from tgi_server.model_runner import ModelRunner
from tgi_server.shard import load_shard
from tgi_server.weights.gguf import load_gguf_tokenizer
from tgi_server.weights.resolve import default_model_path

from . import engine as engine_bench
from .http import launched

KV_DTYPES = (None, "fp8_e4m3fn", "fp8_e5m2")  # None: the model's dtype
KV_BYTES = 64 << 20
PROMPTS = ("The three most important inventions of the nineteenth century were",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Question: Why do leaves change colour in autumn?\nAnswer:",
           "Once upon a time, in a village at the edge of a great forest,",
           "To make a good cup of tea, you should first")
NEW_TOKENS = 128
TEXT_TOKENS = 2000
DECODE_BATCH, DECODE_CONTEXT = 32, 384
LICENSE = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"


def served(kv_cache_dtype: str | None, backend: str | None = None) -> dict:
    """Capacity and greedy token ids of the launcher with this cache (and
    attention backend: None, the default)."""
    args = ("--kv-cache-bytes", str(KV_BYTES)) + (("--kv-cache-dtype", kv_cache_dtype) if kv_cache_dtype else ())
    env = dict(os.environ) | ({"TGI_ATTENTION_BACKEND": backend} if backend else {})
    with tempfile.TemporaryDirectory() as tmp, launched(tmp, args, env=env) as (url, _):
        capacity = httpx.get(url + "/info").json()["max_total_tokens"]

        def one(prompt: str) -> list[int]:
            body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "do_sample": False,
                                                     "details": True, "stop": []}}
            r = httpx.post(url + "/generate", json=body, timeout=600)
            r.raise_for_status()
            return [t["id"] for t in r.json()["details"]["tokens"]]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            return {"capacity": capacity, "tokens": list(pool.map(one, PROMPTS))}


def first_differences(runs: list[list[int]], base: list[list[int]]) -> list[int]:
    """Per prompt, the index of the first generated token that differs from
    the base run's (NEW_TOKENS where none does)."""
    return [next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), NEW_TOKENS)
            for got, want in zip(runs, base)]


def in_process(kv_cache_dtype: str | None, dtype: str | None = None) -> ModelRunner:
    """The default model's shard (in `dtype`; None: the one it picks),
    warmed up, with this cache (640 MiB)."""
    config = ShardConfig(model_id=None, revision=None, uds_path="/unused", dtype=dtype, device="cpu", block_size=16,
                         kv_cache_bytes=640 << 20, attention_backend=None, num_threads=engine_bench.THREADS,
                         kv_cache_dtype=kv_cache_dtype)
    runner, _ = load_shard(config)
    runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=DECODE_CONTEXT * 8, max_batch_size=DECODE_BATCH))
    return runner


@functools.cache
def _tokenizer():
    """The default model's tokenizer, loaded once for the six runners' texts."""
    return load_gguf_tokenizer(default_model_path())


def greedy_tokens(runner: ModelRunner) -> list[list[int]]:
    """NEW_TOKENS greedy token ids per prompt, the five decoding together."""
    ids = [_tokenizer()(p).input_ids for p in PROMPTS]
    blocks = -(-(max(map(len, ids)) + NEW_TOKENS) // runner.block_size)
    first = runner.step(pb.StepRequest(new_sequences=[pb.NewSequence(
        id=i + 1, token_ids=p, prompt_length=len(p), num_scheduled_tokens=len(p),
        block_table=list(range(i * blocks, (i + 1) * blocks)), parameters=pb.SamplingParameters())
        for i, p in enumerate(ids)]))
    tokens = [[g.token_id] for g in first.generations]
    step = pb.StepRequest(running=[pb.RunningSequence(id=i + 1, num_scheduled_tokens=1) for i in range(len(ids))])
    for _ in range(NEW_TOKENS - 1):
        for out, g in zip(tokens, runner.step(step).generations):
            out.append(g.token_id)
    runner.step(pb.StepRequest(release_ids=[i + 1 for i in range(len(ids))]))
    return tokens


def perplexity(runner: ModelRunner) -> float:
    """exp(mean negative logprob) of the text's tokens 2..TEXT_TOKENS, one token a step."""
    ids = _tokenizer()(LICENSE.read_text()).input_ids[:TEXT_TOKENS]
    return float(torch.exp(-chunked_logprobs(runner, ids, 1).mean()))


def decode_steps(runners: dict) -> dict:
    """Median ms of a decode step of DECODE_BATCH sequences of ~DECODE_CONTEXT
    tokens, per runner, timed in turn."""
    blocks = -(-(DECODE_CONTEXT + 64) // 16)
    step = pb.StepRequest(running=[pb.RunningSequence(id=i + 1, num_scheduled_tokens=1) for i in range(DECODE_BATCH)])
    for runner in runners.values():
        seqs = [pb.NewSequence(id=i + 1, token_ids=list(range(100, 100 + DECODE_CONTEXT)),
                               prompt_length=DECODE_CONTEXT, num_scheduled_tokens=DECODE_CONTEXT,
                               block_table=list(range(i * blocks, (i + 1) * blocks)),
                               parameters=pb.SamplingParameters())
                for i in range(DECODE_BATCH)]
        for i in range(0, DECODE_BATCH, 8):
            runner.step(pb.StepRequest(new_sequences=seqs[i:i + 8]))
        runner.step(step)
    times = {kv: [] for kv in runners}
    for _ in range(6):
        for kv, runner in runners.items():
            start = time.perf_counter()
            for _ in range(6):
                runner.step(step)
            times[kv].append((time.perf_counter() - start) / 6 * 1000)
    for runner in runners.values():
        runner.step(pb.StepRequest(release_ids=[i + 1 for i in range(DECODE_BATCH)]))
    return {kv: sorted(t)[len(t) // 2] for kv, t in times.items()}


def run() -> dict:
    torch.set_num_threads(engine_bench.THREADS)
    runs = {kv: served(kv) for kv in KV_DTYPES}
    base = runs[None]
    floor = first_differences(served(None, "sdpa")["tokens"], base["tokens"])
    results = {"kv_fp8_float_capacity": base["capacity"],
               "kv_fp8_noise_floor_greedy_same_of_5": floor.count(NEW_TOKENS)}
    print(f"kv_fp8: float cache, sdpa against the default backend: first differing token per prompt {floor}",
          flush=True)
    for kv in KV_DTYPES[1:]:
        name = kv.removeprefix("fp8_")
        first = first_differences(runs[kv]["tokens"], base["tokens"])
        print(f"kv_fp8: {name}: first differing token per prompt {first} (of {NEW_TOKENS})", flush=True)
        results |= {f"kv_fp8_{name}_capacity_ratio": runs[kv]["capacity"] / base["capacity"],
                    f"kv_fp8_{name}_greedy_same_of_5": first.count(NEW_TOKENS)}
    # The same five prompts and text with the model in float32, in process: what float8
    # alone changes, without bf16's rounding (whose kernel swap alone changes most answers).
    exact, exact_ppl = {}, {}
    for kv in KV_DTYPES:
        runner = in_process(kv, "float32")
        exact[kv], exact_ppl[kv] = greedy_tokens(runner), perplexity(runner)
        del runner
    for kv in KV_DTYPES[1:]:
        name = kv.removeprefix("fp8_")
        first = first_differences(exact[kv], exact[None])
        print(f"kv_fp8: {name}, model in float32: first differing token per prompt {first} (of {NEW_TOKENS}), "
              f"perplexity {exact_ppl[kv]:.4f} against {exact_ppl[None]:.4f}", flush=True)
        results |= {f"kv_fp8_{name}_float32_greedy_same_of_5": first.count(NEW_TOKENS),
                    f"kv_fp8_{name}_float32_perplexity_ratio": exact_ppl[kv] / exact_ppl[None]}
    runners = {kv: in_process(kv) for kv in KV_DTYPES}
    ppl = {kv: perplexity(runner) for kv, runner in runners.items()}
    step_ms = decode_steps(runners)
    print(f"kv_fp8: capacity (tokens) {[runs[kv]['capacity'] for kv in KV_DTYPES]}, perplexity "
          f"{[round(ppl[kv], 4) for kv in KV_DTYPES]}, decode step ms (batch {DECODE_BATCH}) "
          f"{[round(step_ms[kv], 1) for kv in KV_DTYPES]} (float, e4m3fn, e5m2)", flush=True)
    for kv in KV_DTYPES[1:]:
        name = kv.removeprefix("fp8_")
        results |= {f"kv_fp8_{name}_perplexity_ratio": ppl[kv] / ppl[None],
                    f"kv_fp8_{name}_decode_step_ratio": step_ms[kv] / step_ms[None]}
    return results | {"kv_fp8_float_perplexity": ppl[None]}
