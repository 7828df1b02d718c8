"""Placement benchmark: how many OpenMP threads a shard runs and how they
wait, measured on our server (the default model, over HTTP, the peers
benchmark's load generator) alone and beside a competing process.

For each setting (PLACEMENT_SETTINGS: threads and the shard's OpenMP
environment) the launcher is started once and measured at concurrency 1 and
32, then at concurrency 1 again while a competitor keeps every core busy:
a torch process (its own default OpenMP settings, one thread a core) doing
float32 GEMMs back to back, what a second shard or a build on the same
machine looks like to ours. A shard whose OpenMP threads spin-wait at every
barrier collapses then (each of its ~300 parallel regions a step waits for
the one thread that lost its core); one whose threads sleep degrades in
proportion to the CPU it gets; ours fits its thread count to the cores the
competitor leaves (server/tgi_server/thread_governor.py). Keys: placement_<setting>_c1_tok_s,
..._c32_tok_s, ..._c1_contended_tok_s and ..._c1_contended_share (the
contended c=1 over the quiet one: 0.5 is an even share of two cores)."""

import asyncio
import os
import subprocess
import sys
import tempfile

from . import engine as engine_bench
from .http import launched
from .peers import make_prompts, measure

NEW_TOKENS = 64
CONTENDED_TOKENS = 32   # a collapsed setting answers ~2 tokens a second: keep its load short
# name -> (threads, variables added to the shard's environment)
SETTINGS = {
    # what the launcher does by itself: libgomp's spinning waits, threads fitted to the free cores
    "ours": (engine_bench.THREADS, {}),
    # the same threads held fixed: libgomp's default spins 300,000 rounds, then sleeps
    "fixed_spinning": (engine_bench.THREADS, {"TGI_THREAD_GOVERNOR": "0"}),
    "fixed_sleeping": (engine_bench.THREADS, {"TGI_THREAD_GOVERNOR": "0", "OMP_WAIT_POLICY": "PASSIVE"}),
    "one_thread": (1, {}),
}
SELECTED = [s for s in os.environ.get("PLACEMENT_SETTINGS", ",".join(SETTINGS)).split(",") if s in SETTINGS]
COMPETITOR = ("import torch\n"
              "a = torch.randn(512, 512)\n"
              "while True:\n"
              "    a @ a\n")


def _competitor() -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    env["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)
    return subprocess.Popen([sys.executable, "-c", COMPETITOR], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def measure_setting(threads: int, env: dict[str, str], prompts: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        with launched(tmp, threads=threads, env=env) as (url, _):
            asyncio.run(measure(url, prompts["warmup"], 1, 8))
            out = {f"c{c}": asyncio.run(measure(url, prompts[c], c, NEW_TOKENS)) for c in (1, 32)}
            competitor = _competitor()
            try:
                asyncio.run(measure(url, prompts["warmup"], 1, 4))  # the competitor is up and running
                out["c1_contended"] = asyncio.run(measure(url, prompts["contended"], 1, CONTENDED_TOKENS))
            finally:
                competitor.kill()
                competitor.wait()
    return out


def run() -> dict:
    from tgi_server.weights.gguf import load_gguf_tokenizer
    from tgi_server.weights.resolve import default_model_path

    tokenizer = load_gguf_tokenizer(default_model_path())
    prompts = {"warmup": make_prompts(tokenizer, "Warm-up", 1), 1: make_prompts(tokenizer, "One", 4),
               32: make_prompts(tokenizer, "Many", 32), "contended": make_prompts(tokenizer, "Shared", 2)}
    out: dict = {}
    print(f"Placement benchmark: our server, default model, {NEW_TOKENS} new tokens ({CONTENDED_TOKENS} "
          f"contended), competitor: a {os.cpu_count()}-thread torch GEMM loop")
    print(f"{'setting':<18}{'threads':>8}{'c=1 tok/s':>11}{'ITL p50':>9}{'c=32 tok/s':>12}"
          f"{'contended c=1':>15}{'ITL p50':>9}{'share':>7}")
    for name in SELECTED:
        threads, changes = SETTINGS[name]
        r = measure_setting(threads, {**os.environ, **changes}, prompts)
        quiet, busy = r["c1"], r["c1_contended"]
        share = busy["tok_s"] / quiet["tok_s"] if quiet["tok_s"] else None
        print(f"{name:<18}{threads:>8}{quiet['tok_s']:>11.1f}{quiet['itl_p50_ms']:>9.1f}{r['c32']['tok_s']:>12.1f}"
              f"{busy['tok_s']:>15.1f}{busy['itl_p50_ms']:>9.1f}{share if share is not None else float('nan'):>7.2f}",
              flush=True)
        out[f"placement_{name}_c1_tok_s"] = round(quiet["tok_s"], 1)
        out[f"placement_{name}_c1_itl_p50_ms"] = round(quiet["itl_p50_ms"], 1)
        out[f"placement_{name}_c32_tok_s"] = round(r["c32"]["tok_s"], 1)
        out[f"placement_{name}_c1_contended_tok_s"] = round(busy["tok_s"], 1)
        out[f"placement_{name}_c1_contended_share"] = None if share is None else round(share, 2)
    return out
