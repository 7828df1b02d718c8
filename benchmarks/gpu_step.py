"""Where a decode step's time goes inside one shard on a GPU (no router, no gRPC).

`python -m benchmarks.gpu_step [--out DIR]` loads gpu_check's random 1.1B
Llama (bf16, CUDA graphs) in this process and prints one JSON line:
  - hf_*: the shard against transformers on the same checkpoint (prompt
    logprobs of a 64-token prompt, then 16 greedy tokens through the graphs);
  - b{1,32,128}: milliseconds per decode step in each phase of
    ModelRunner.step, by its own timings (PHASES), and the step's wall time;
  - graph_gpu_ms_b*: one replay of the decode graph alone (CUDA events) and
    graph_launch_ms_b* the host's time to launch it.
With --out, torch.profiler tables of 20 steps at batch 1 and 32 and the batch-1
Chrome trace land there. `--smoke-cpu` runs the same on a tiny model on CPU
(no graphs), to check the plumbing.
"""

import argparse
import gzip
import json
import tempfile
import time
from pathlib import Path

import torch

from tgi_proto import pb
from tgi_server.config import ShardConfig
from tgi_server.model_runner import ModelRunner
from tgi_server.shard import load_shard

from .gpu_check import MODEL, write_random_llama

# ModelRunner.step's own timings (pb.Timings): sequence table and batch; the
# logits' launch (graph replay or eager forward); sampling, which waits for the GPU.
PHASES = ("prepare", "forward", "sample", "total")
PROMPT_TOKENS = 128
STEPS = 64


class Driver:
    """Steps a ModelRunner directly: prompts of PROMPT_TOKENS, then decode steps."""

    def __init__(self, runner: ModelRunner, vocab: int):
        self.runner, self.vocab = runner, vocab
        self.step_id = 0

    def _step(self, **fields) -> pb.StepResponse:
        self.step_id += 1
        return self.runner.step(pb.StepRequest(step_id=self.step_id, **fields))

    def start(self, batch: int, max_tokens: int) -> list[int]:
        """batch fresh sequences prefilled; returns their ids."""
        self.runner.table.clear()
        per_seq = -(-max_tokens // self.runner.block_size)
        new = [pb.NewSequence(id=i + 1, token_ids=[(7 * i + j) % self.vocab for j in range(PROMPT_TOKENS)],
                              prompt_length=PROMPT_TOKENS, num_scheduled_tokens=PROMPT_TOKENS,
                              block_table=list(range(i * per_seq, (i + 1) * per_seq)),
                              parameters=pb.SamplingParameters()) for i in range(batch)]
        self._step(new_sequences=new)
        return [n.id for n in new]

    def decode(self, ids: list[int]) -> pb.StepResponse:
        return self._step(running=[pb.RunningSequence(id=i, num_scheduled_tokens=1) for i in ids])


def compare_with_transformers(driver: Driver, model_dir: Path, device: str) -> dict:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(device).eval()
    prompt = [(13 * j + 5) % driver.vocab for j in range(64)]
    driver.runner.table.clear()
    driver.step_id += 1
    first = driver.runner.step(pb.StepRequest(step_id=driver.step_id, new_sequences=[pb.NewSequence(
        id=1, token_ids=prompt, prompt_length=len(prompt), num_scheduled_tokens=len(prompt),
        block_table=list(range(-(-(len(prompt) + 16) // driver.runner.block_size))),
        parameters=pb.SamplingParameters(prefill_logprobs=True))])).generations[0]
    ours_lp = torch.tensor([t.logprob for t in first.prefill_tokens[1:]])
    tokens = [first.token_id] + [driver.decode([1]).generations[0].token_id for _ in range(15)]
    with torch.no_grad():
        ids = torch.tensor([prompt], device=device)
        lp = torch.log_softmax(hf(ids).logits[0].float(), -1)
        hf_lp = lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].cpu()
        hf_tokens = hf.generate(ids, max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
    same = next((i for i, (a, b) in enumerate(zip(tokens, hf_tokens)) if a != b), len(tokens))
    return {"hf_prompt_logprob_maxdiff": round(float((ours_lp - hf_lp).abs().max()), 4),
            "hf_greedy_same_prefix_of_16": same}


def profile(driver: Driver, ids: list[int], out: Path, name: str, device: str, trace: bool) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(20):
            driver.decode(ids)
        if device == "cuda":
            torch.cuda.synchronize()
    (out / f"{name}.txt").write_text(prof.key_averages().table(sort_by="cpu_time_total", row_limit=60,
                                                               max_name_column_width=70))
    if trace:
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(f"{tmp}/trace.json")
            (out / f"{name}.json.gz").write_bytes(gzip.compress(Path(f"{tmp}/trace.json").read_bytes()))


def graph_times(runner: ModelRunner, sizes: tuple[int, ...]) -> dict:
    out = {}
    for size in sizes:
        replay = runner.graphs.graphs[size]
        for _ in range(3):
            replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            replay()
        end.record()
        torch.cuda.synchronize()
        out[f"graph_gpu_ms_b{size}"] = round(start.elapsed_time(end) / 50, 3)
        t = time.perf_counter()
        for _ in range(50):
            replay()
        out[f"graph_launch_ms_b{size}"] = round(1000 * (time.perf_counter() - t) / 50, 3)
        torch.cuda.synchronize()
    return out


def run(device: str, config: dict, batches: tuple[int, ...], out: Path | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        write_random_llama(model_dir, config, device)
        shard = ShardConfig(model_id=str(model_dir), revision=None, uds_path=f"{tmp}/shard", dtype="bfloat16",
                            device=device, block_size=16, kv_cache_bytes=(8 << 30) if device == "cuda" else 64 << 20,
                            attention_backend=None, num_threads=0, cuda_graphs=(1, 2, 4, 8, 16, 32, 64, 128))
        runner, _ = load_shard(shard)
        runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=8192, max_batch_size=max(batches)))
        driver = Driver(runner, config["vocab_size"])
        result = {"backend": runner.backend, "graphs": runner.graphs is not None,
                  **compare_with_transformers(driver, model_dir, device)}
        for b in batches:
            ids = driver.start(b, PROMPT_TOKENS + STEPS + 20)
            totals = dict.fromkeys(PHASES, 0)
            start = time.perf_counter()
            for _ in range(STEPS):
                timings = driver.decode(ids).timings
                for phase in PHASES:
                    totals[phase] += getattr(timings, f"{phase}_ns")
            timed = {f"{phase}_ms": round(ns / 1e6 / STEPS, 3) for phase, ns in totals.items()}
            timed["step_ms"] = round(1000 * (time.perf_counter() - start) / STEPS, 3)
            result[f"b{b}"] = timed
            if out is not None and b in (1, 32):
                profile(driver, ids, out, f"profile_b{b}", device, trace=b == 1)
        if runner.graphs is not None:
            result.update(graph_times(runner, tuple(b for b in batches if b in runner.graphs.graphs)))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for the profiler tables and trace")
    parser.add_argument("--smoke-cpu", action="store_true", help="a tiny model on CPU: the plumbing only")
    args = parser.parse_args()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke_cpu:
        tiny = dict(MODEL, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=320)
        print(json.dumps(run("cpu", tiny, (1, 4), args.out)))
        return
    print(json.dumps(run("cuda", MODEL, (1, 32, 128), args.out)))


if __name__ == "__main__":
    main()
