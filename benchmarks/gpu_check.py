"""`make gpu-check`: everything the CUDA path needs proven, in one command
under 10 minutes on one GPU, ending with ONE JSON line on stdout.

Stages, each with its own deadline (a stage that fails or times out is
reported, and the later stages that need it are skipped):
  1. env    find a Python whose torch sees CUDA ($GPU_PYTHON, build/venv-gpu, python3);
            failing that, build build/venv-gpu (system site packages) and pip-install
            the project with its `cuda` and `test` extras, then flash-attn from a
            prebuilt wheel if one is reachable (never built from source).
  2. tests  `pytest -m gpu` over the files that hold GPU tests: attention kernels against
            the reference, flash-attn, CUDA graphs, the quantized GEMM.
  3. bench  a Llama-architecture model of ~1.1B parameters (TinyLlama's shape)
            with random bf16 weights, served by a shard process with CUDA graphs,
            driven by the router's scheduler at batch 1, 32 and 128: tokens/s,
            decode tokens/s, TTFT and GPU memory.
  4. quant_bench  our Triton 4/8-bit GEMM against bf16 at a 1.1B Llama's MLP shapes
            (benchmarks/quant_cuda.py).

Only the standard library is imported at the top: stage 1 runs before any
dependency is known to exist. `--bench-only` runs stage 3 in this interpreter.
"""

import sys
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # run as a file: benchmarks/http.py would shadow the standard library's http

import argparse  # noqa: E402
import ast  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# Seconds per stage. The GPU tests compile ~40 Triton kernel variants on a fresh machine.
DEADLINES = {"env": 60, "install": 240, "tests": 360, "bench": 120, "quant_bench": 90}
TOTAL_S = 570  # and all together: every command is cut off so that the JSON line comes within 10 minutes
_END = time.monotonic() + TOTAL_S
BATCHES = (1, 32, 128)
PROMPT_TOKENS, NEW_TOKENS = 128, 128
# TinyLlama-1.1B's shape: 22 layers, hidden 2048, 32 query / 4 kv heads, vocab 32000.
MODEL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
             rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False, model_type="llama", architectures=["LlamaForCausalLM"],
             torch_dtype="bfloat16")
KV_CACHE_BYTES = 8 << 30


def _run(cmd: list[str], timeout: float, **kw) -> tuple[int, str]:
    """(exit code, combined output); 124 on timeout (its own, or the whole check's)."""
    timeout = max(5.0, min(timeout, _END - time.monotonic()))
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, cwd=ROOT, **kw)
        return done.returncode, done.stdout
    except subprocess.TimeoutExpired as err:
        out = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        return 124, out + f"\n[timed out after {timeout:.0f} s]"
    except OSError as err:
        return 127, str(err)


def _cuda_python(candidates: list[str]) -> tuple[str | None, str]:
    probe = "import torch, tgi_server, tgi_router; assert torch.cuda.is_available(); print(torch.__version__)"
    notes = []
    for python in candidates:
        if not python or not (Path(python).exists() or "/" not in python):
            continue
        code, out = _run([python, "-c", probe], DEADLINES["env"], env=dict(os.environ, PYTHONPATH=_pythonpath()))
        if code == 0:
            return python, out.strip().splitlines()[-1]
        notes.append(f"{python}: {out.strip().splitlines()[-1] if out.strip() else code}")
    return None, "; ".join(notes)


def _pythonpath() -> str:
    # The packages import from the source tree whether or not they are installed;
    # a PYTHONPATH already set (packages carried to a machine without an index) stays behind them.
    dirs = [str(ROOT / d) for d in ("router", "server", "kernels", "proto")]
    return os.pathsep.join(dirs + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def _keep_log(stage: str, out: str) -> None:
    """A stage's whole output into $GPU_CHECK_LOGS/<stage>.log when that is set (the JSON line keeps only tails)."""
    if folder := os.environ.get("GPU_CHECK_LOGS"):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{stage}.log").write_text(out)


def gpu_test_files() -> list[str]:
    """The test files that hold @pytest.mark.gpu tests: collecting only these keeps the
    end-to-end suites' extra dependencies (schemathesis, openai, ...) off the GPU machine."""
    def marked(path: Path) -> bool:  # the expression `pytest.mark.gpu` in the code, not in a string
        return any(isinstance(node, ast.Attribute) and ast.unparse(node) == "pytest.mark.gpu"
                   for node in ast.walk(ast.parse(path.read_text())))

    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if marked(p))


def stage_env(result: dict) -> str | None:
    if not Path("/dev/nvidia0").exists() and _run(["nvidia-smi", "-L"], 30)[0] != 0:
        result["env"] = {"ok": False, "error": "no NVIDIA GPU on this machine (no /dev/nvidia0, no nvidia-smi)"}
        return None
    venv = ROOT / "build" / "venv-gpu"
    candidates = [os.environ.get("GPU_PYTHON", ""), str(venv / "bin/python"), "python3", sys.executable]
    python, note = _cuda_python(candidates)
    if python is None:
        start = time.monotonic()
        log = []
        if not (venv / "bin/python").exists():
            venv.parent.mkdir(exist_ok=True)
            log.append(_run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], 60))
        pip = [str(venv / "bin/python"), "-m", "pip", "install", "-q", "--retries", "1", "--timeout", "20"]
        left = DEADLINES["install"] - (time.monotonic() - start)
        log.append(_run(pip + ["-e", ".[cuda,test]"], max(30, left)))
        python, note = _cuda_python([str(venv / "bin/python")])
        result["install"] = {"ok": python is not None, "log_tail": "".join(o for _, o in log)[-1500:]}
    if python is None:
        result["env"] = {"ok": False, "error": "no Python with a CUDA torch and this project's dependencies: "
                         f"{note}. Set GPU_PYTHON, or give the machine a package index."}
        return None
    # flash-attn: only a prebuilt wheel (a source build takes an hour); its absence is not a failure.
    code, _ = _run([python, "-c", "import flash_attn"], 60)
    if code != 0:
        _run([python, "-m", "pip", "install", "-q", "--only-binary", ":all:", "--retries", "1", "--timeout", "20",
              "flash-attn"], 120)
    code, out = _run([python, "-c", "import torch, triton; import importlib.util as u; "
                      "print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), "
                      "u.find_spec('flash_attn') is not None)"], 60)
    result["env"] = {"ok": code == 0, "python": python, "versions": out.strip().splitlines()[-1] if out else ""}
    return python if code == 0 else None


def _workers(python: str) -> list[str]:
    """pytest-xdist's `-n` where that Python has it (the GPU machine's image does):
    the GPU tests' time is mostly Triton compiling kernel variants on the CPU
    (figures: docs/tuning.md#gpu-check-workers), which workers share out."""
    if _run([python, "-c", "import xdist"], 30)[0] != 0:
        return []
    return ["-n", str(max(1, min(8, (os.cpu_count() or 2) // 2)))]


def stage_tests(python: str, result: dict) -> None:
    code, out = _run([python, "-m", "pytest", "-m", "gpu", "-q", "-rfEs", "-p", "no:cacheprovider",
                      *_workers(python), *gpu_test_files()], DEADLINES["tests"],
                     env=dict(os.environ, PYTHONPATH=_pythonpath()))
    _keep_log("tests", out)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", out)}
    result["tests"] = {"ok": code == 0 and counts.get("passed", 0) > 0, "exit": code, **counts}
    if code != 0:
        result["tests"]["output_tail"] = out[-3000:]


def _json_stage(name: str, module_args: list[str], python: str, result: dict) -> None:
    """result[name]: the last JSON line of `python -m <module_args>`, or its failure."""
    code, out = _run([python, "-m", *module_args], DEADLINES[name], env=dict(os.environ, PYTHONPATH=_pythonpath()))
    _keep_log(name, out)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if code == 0 and lines:
        result[name] = {"ok": True, **json.loads(lines[-1])}
    else:
        result[name] = {"ok": False, "exit": code, "output_tail": out[-3000:]}


def stage_bench(python: str, result: dict) -> None:
    _json_stage("bench", ["benchmarks.gpu_check", "--bench-only"], python, result)


def stage_quant_bench(python: str, result: dict) -> None:
    """Our Triton quantized GEMM against bf16 F.linear (benchmarks/quant_cuda.py)."""
    _json_stage("quant_bench", ["benchmarks.quant_cuda"], python, result)


# --- stage 3, run inside the CUDA Python ------------------------------------------------------


def write_random_llama(path: Path, c: dict, device: str) -> int:
    """A random bf16 checkpoint of config c's shape (config.json + safetensors); returns its parameter count."""
    import torch
    from safetensors.torch import save_file

    h, inter = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]  # rows of k_proj / v_proj
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,),
              "lm_head.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = {name: (torch.ones(shape, device=device) if len(shape) == 1
                      else torch.randn(shape, device=device, generator=gen) * 0.02).to(torch.bfloat16).cpu()
               for name, shape in shapes.items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(c))
    return sum(t.numel() for t in tensors.values())


def gpu_memory_used_mib() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) >> 20


async def one_batch(client, warm, prompts: list[list[int]], new_tokens: int,
                    plan_ahead: bool = True) -> tuple[dict, list[list[int]]]:
    """(figures, each prompt's greedy tokens) of one batch run; shard_*_ms: the shard's own
    medians per step (prepare: sequence table and input tensors; forward: the forward's launch,
    or all of it where nothing is asynchronous; sample: sampling, which waits for the GPU)."""
    from benchmarks.engine import run_batch

    times = await run_batch(client, warm, prompts, new_tokens, max_batch_tokens=8192, plan_ahead=plan_ahead)
    ttfts = times.first_token
    return ({"tok_s": round(times.generated / times.elapsed, 1),
             "decode_tok_s": round(times.decode_tokens / max(times.decode_time, 1e-9), 1),
             "ttft_ms_p50": round(1000 * ttfts[len(ttfts) // 2], 1), "ttft_ms_max": round(1000 * ttfts[-1], 1),
             **{f"shard_{part}_ms": ms for part, ms in times.shard_ms.items()}}, times.outputs)


async def drive(socket: str, vocab: int, batches: tuple[int, ...], new_tokens: int, kv_cache_bytes: int) -> dict:
    import random

    from tgi_router.scheduling.client import ShardClient

    client = ShardClient([socket], timeout=240)
    try:
        await client.wait_ready(180)
        info = await client.info()
        warm = await client.warmup(8192, max(batches), kv_cache_bytes=kv_cache_bytes)
        rng = random.Random(0)
        prompts = [[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(max(batches))]
        await one_batch(client, warm, prompts[:2], 4)  # first-call costs (kernel compilation) out of the way
        out = {"attention_backend": info.attention_backend, "memory_after_warmup_mib": gpu_memory_used_mib()}
        for b in batches:
            figures, tokens = await one_batch(client, warm, prompts[:b], new_tokens)
            out.update({f"b{b}_{key}": value for key, value in figures.items()})
            if b == batches[0]:
                # The same batch with async scheduling off: what planning ahead gains, and
                # that it changes no greedy token.
                figures, same = await one_batch(client, warm, prompts[:b], new_tokens, plan_ahead=False)
                out.update({f"b{b}_sync_{key}": value for key, value in figures.items()})
                out[f"b{b}_async_same_tokens"] = same == tokens
        out["memory_peak_mib"] = gpu_memory_used_mib()  # the cache is preallocated: use is flat after warmup
        return out
    finally:
        await client.close()


def bench(device: str = "cuda", config: dict = MODEL, batches: tuple[int, ...] = BATCHES,
          new_tokens: int = NEW_TOKENS) -> dict:
    """The benchmark; a CPU run with a tiny config (--smoke-cpu) checks the plumbing."""
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        params = write_random_llama(Path(tmp) / "model", config, device)
        graphs = ",".join(str(n) for n in (1, 2, 4, 8, 16, 32, 64, 128))
        # The CPU smoke run's cache: 8 GiB there was zeroed page by page at Warmup (~10 s of system time).
        kv_cache_bytes = KV_CACHE_BYTES if device == "cuda" else 64 << 20
        shard = subprocess.Popen(
            [sys.executable, "-m", "tgi_server.cli", "serve", str(Path(tmp) / "model"), "--uds-path",
             f"{tmp}/shard", "--device", device, "--dtype", "bfloat16", "--cuda-graphs", graphs,
             "--kv-cache-bytes", str(kv_cache_bytes)],
            stdout=sys.stderr, stderr=sys.stderr)
        try:
            out = asyncio.run(drive(f"{tmp}/shard-0", config["vocab_size"], batches, new_tokens, kv_cache_bytes))
        finally:
            shard.terminate()
            shard.wait(30)
    return {"model_params_b": round(params / 1e9, 3), "prompt_tokens": PROMPT_TOKENS,
            "new_tokens": new_tokens, **out, "bench_s": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench-only", action="store_true", help="stage 3 only, in this interpreter")
    parser.add_argument("--smoke-cpu", action="store_true", help="stage 3's plumbing with a tiny model on CPU")
    args = parser.parse_args()
    if args.bench_only:
        print(json.dumps(bench()))
        return
    if args.smoke_cpu:
        tiny = dict(MODEL, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=320)
        print(json.dumps(bench("cpu", tiny, (1, 4), 4)))
        return
    start = time.monotonic()
    result: dict = {"check": "gpu"}
    python = stage_env(result)
    if python:
        stage_tests(python, result)
        stage_bench(python, result)
        stage_quant_bench(python, result)
    result["ok"] = all(v.get("ok") for v in result.values() if isinstance(v, dict)) and python is not None
    result["total_s"] = round(time.monotonic() - start, 1)
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
