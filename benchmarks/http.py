"""HTTP load benchmark: N streaming requests at concurrency C against the
real launcher (SmolLM2, 2 threads, started without --dtype: the dtype the
shard chooses on this CPU), with the transformers one-at-a-time baseline
(in that dtype) and the engine's own batch-1 speed (shard over its socket, no
router) measured in the same run."""

import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from . import engine as engine_bench
from .machine import dtype_name, serving_dtype

LOADS = ((1, 4), (32, 64))  # (concurrency, requests)


def free_port() -> int:
    """A loopback port free now, drawn below the kernel's ephemeral range
    (/proc/sys/net/ipv4/ip_local_port_range). Gloo's listening sockets and
    every outgoing connection take ports from that range, so a port the
    kernel handed out as ephemeral could be taken again before the server
    binds it (CI: uvicorn's bind failed with EADDRINUSE beside three gloo
    shards). The tests' servers take theirs here too."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:
        low = 32768
    draw = random.Random()  # seeded from the OS, not by any test's random.seed
    for _ in range(1000 if low > 11000 else 0):  # a range starting low leaves no room below it
        port = draw.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # what the kernel hands out
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _one(client: httpx.AsyncClient, url: str, prompt: str) -> dict:
    """One streaming request: token arrival times (and an error, if any)."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": engine_bench.NEW_TOKENS, "do_sample": False,
                                             "stop": []}}
    start = time.perf_counter()
    times, error = [], None
    async with client.stream("POST", url + "/generate_stream", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                if "error" in event:
                    error = event["error"]
                    break
                times.append(time.perf_counter() - start)
    return {"times": times, "error": error or (None if r.status_code == 200 else r.status_code)}


async def gather_limited(run, items: list, concurrency: int) -> tuple[list, float]:
    """(await run(item) for every item, at most `concurrency` at once, in
    order; the seconds they took together)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(item):
        async with sem:
            return await run(item)
    start = time.perf_counter()
    results = await asyncio.gather(*(one(item) for item in items))
    return results, time.perf_counter() - start


def pct_ms(values: list[float], q: float) -> float:
    """The q-quantile of sorted seconds, in milliseconds (nan if none)."""
    return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else float("nan")


async def load(url: str, prompts: list[str], concurrency: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        results, elapsed = await gather_limited(lambda p: _one(client, url, p), prompts, concurrency)
    tokens = sum(len(r["times"]) for r in results)
    ttft = sorted(r["times"][0] for r in results if r["times"])
    itl = sorted(b - a for r in results for a, b in zip(r["times"], r["times"][1:]))
    return {"tok_s": tokens / elapsed, "ttft_p50_ms": pct_ms(ttft, 0.5), "ttft_p99_ms": pct_ms(ttft, 0.99),
            "itl_p50_ms": pct_ms(itl, 0.5), "itl_p99_ms": pct_ms(itl, 0.99),
            "errors": sum(r["error"] is not None for r in results)}


def _launch(port: int, tmp: str, extra_args: tuple[str, ...], log, threads: int,
            env: dict[str, str] | None) -> subprocess.Popen:
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS=str(threads))
    return subprocess.Popen(
        [sys.executable, "-m", "tgi_router.launch.launcher", "--port", str(port), "--hostname", "127.0.0.1",
         "--shard-uds-path", f"{tmp}/shard", "--num-threads", str(threads),
         "--kv-cache-bytes", str(1 << 30), "--max-concurrent-requests", "256", *extra_args],
        env=env, stdout=log, stderr=log)


@contextlib.contextmanager
def launched(tmp: str, extra_args: tuple[str, ...] = (), log=subprocess.DEVNULL,
             threads: int = engine_bench.THREADS, env: dict[str, str] | None = None):
    """The real launcher on a free port, its shard sockets in `tmp` (more
    launcher flags in `extra_args`, its output to `log`, `threads` torch
    threads a shard, `env` instead of this process's environment); yields
    (its URL, its process: the router runs in it, the shards in its children)
    once healthy, stops it on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _launch(port, tmp, extra_args, log, threads, env)
    try:
        _wait_healthy(url, proc)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(60)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process's own threads (not its
    children): fields 14 and 15 of /proc/PID/stat, in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the name (field 2) may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become healthy")


def run() -> dict:
    torch.set_num_threads(engine_bench.THREADS)
    model, tokenizer, path = engine_bench.hf_model(serving_dtype())
    prompt_ids = engine_bench.make_prompts(tokenizer, max(n for _, n in LOADS))
    prompts = [tokenizer.decode(p) for p in prompt_ids]
    engine_bench.hf_throughput(model, prompt_ids[:1])
    hf_b1 = max(engine_bench.hf_throughput(model, [p]) for p in prompt_ids[:engine_bench.HF_SEQUENTIAL_PROMPTS])
    del model
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        with launched(tmp) as (url, _):
            asyncio.run(load(url, prompts[:2], 2))  # warm up
            for c, n in LOADS:
                runs = [asyncio.run(load(url, prompts[:n], c)) for _ in range(engine_bench.REPEATS)]
                results[c] = max(runs, key=lambda r: r["tok_s"])
        shard = engine_bench.start_shard(path, tmp)
        try:
            engine_b1 = asyncio.run(_engine_b1(f"{tmp}/shard-0", prompt_ids[:1]))
        finally:
            shard.terminate()
            shard.wait(30)
    print(f"\nHTTP benchmark: SmolLM2-135M {dtype_name(serving_dtype())}, {engine_bench.THREADS} threads, prompts "
          f"{engine_bench.PROMPT_TOKENS} tokens, {engine_bench.NEW_TOKENS} new tokens, /generate_stream")
    print(f"{'':<26}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'errors':>8}")
    print(f"{'transformers, sequential':<26}{hf_b1:>8.1f}")
    print(f"{'engine, shard socket, b1':<26}{engine_b1:>8.1f}")
    for c, r in results.items():
        print(f"{'http, concurrency ' + str(c):<26}{r['tok_s']:>8.1f}{r['ttft_p50_ms']:>10.0f}{r['ttft_p99_ms']:>10.0f}"
              f"{r['itl_p50_ms']:>9.1f}{r['itl_p99_ms']:>9.1f}{r['errors']:>8}")
    out = {"http_hf_sequential_tok_s": round(hf_b1, 1), "http_engine_b1_tok_s": round(engine_b1, 1)}
    for c, r in results.items():
        out.update({f"http_c{c}_{k}": round(v, 1) for k, v in r.items()})
    out["http_c32_vs_hf_sequential"] = round(results[32]["tok_s"] / hf_b1, 2)
    out["http_c1_vs_engine_b1"] = round(results[1]["tok_s"] / engine_b1, 2)
    return out


async def _engine_b1(socket_path: str, prompts: list[list[int]]) -> float:
    """End-to-end tokens/s of one request at a time straight over the shard socket."""
    from tgi_router.scheduling.client import ShardClient

    client = ShardClient([socket_path], timeout=600)
    try:
        await client.wait_ready(180)
        warm = await client.warmup(4096, 64, kv_cache_bytes=1 << 30)
        await engine_bench.engine_throughput(client, warm, prompts)
        return max([(await engine_bench.engine_throughput(client, warm, prompts))[0]
                    for _ in range(engine_bench.REPEATS)])
    finally:
        await client.close()
