"""Test helpers: tiny random checkpoints, a shard served in-process over a
real unix socket, and a driver that runs prompts through the router's
scheduler to completion."""

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from benchmarks.http import free_port
from tgi_proto import pb
from tgi_router.scheduling.block_manager import BlockManager
from tgi_router.scheduling.client import ShardClient
from tgi_router.scheduling.engine import Engine
from tgi_router.scheduling.scheduler import Scheduler
from tgi_router.scheduling.sequence import Sequence, StoppingCriteria
from tgi_router.scheduling.speculation import SpeculationPolicy
from tgi_server.config import ShardConfig
from tgi_server.model_runner import ModelRunner
from tgi_server.service import serve
from tgi_server.shard import load_shard

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
TINY_EXTRA = {
    "llama": dict(rope_theta=10000.0),
    "mistral": dict(sliding_window=24, rope_theta=10000.0),
    "qwen2": dict(rope_theta=10000.0, tie_word_embeddings=True),
    # q/k norms; every other layer windowed (shorter than the longer prompts)
    "qwen3": dict(head_dim=16, use_sliding_window=True, sliding_window=24, max_window_layers=1,
                  layer_types=["full_attention", "sliding_attention", "full_attention"], num_hidden_layers=3),
    # the second of three layers applies no RoPE
    "smollm3": dict(no_rope_layers=[1, 0, 1], num_hidden_layers=3, rope_theta=10000.0, pad_token_id=None),
    # local layers (window 24, base 10,000) around a global one (its own base
    # and linear scaling); q/k norms, sandwich norms, GeGLU, a soft cap
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=24, num_hidden_layers=3,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                            "factor": 4.0}},
                        final_logit_softcapping=30.0, tie_word_embeddings=True),
    # gemma3's norms and scales without q/k norms, local and global layers
    # alternating, attention scores capped softly (a cap of 2 bites on these
    # random weights), logits too
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=24, num_hidden_layers=3,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   attn_logit_softcapping=2.0, final_logit_softcapping=30.0, rope_theta=10000.0,
                   tie_word_embeddings=True),
    # fused qkv and gate_up tensors, RoPE on half of each head (longrope's
    # short factors below its original 256 positions), windows of 24
    "phi3": dict(sliding_window=24, max_position_embeddings=512, pad_token_id=None,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                  "original_max_position_embeddings": 256,
                                  "short_factor": [1.0, 1.3, 2.0, 3.0],
                                  "long_factor": [1.0, 3.0, 6.0, 12.0]}),
    # 8 experts, top 2 (mixtral always renormalizes them)
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, rope_theta=10000.0, sliding_window=None),
    # a shared expert beside 8 routed ones, top 2 not renormalized; the
    # second of three layers a dense MLP (mlp_only_layers)
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1],
                      num_hidden_layers=3, rope_theta=10000.0),
    # q/k norms; top 2 of 8 renormalized; experts on every other layer (decoder_sparse_step 2)
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      decoder_sparse_step=2, num_hidden_layers=3, head_dim=16, rope_theta=10000.0),
}
HF_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
}


def save_tiny_model(model_type: str, path: Path, seed: int = 0, **overrides) -> Path:
    """A random `model_type` checkpoint saved with save_pretrained (float32)."""
    config_cls, model_cls = HF_CLASSES[model_type]
    config = config_cls(**{**TINY, **TINY_EXTRA[model_type], **overrides})
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():  # random init is tiny; scale up so logits are not all ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    return path


def with_tensors(source: Path, tensors: dict[str, torch.Tensor], out: Path) -> Path:
    """A copy of checkpoint directory `source` at `out` whose weights are
    `tensors` (names as on disk: transformers renames them on load as it
    would the original's)."""
    shutil.copytree(source, out)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """transformers' greedy `generate` for one prompt; eos None: never stops early."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def chunked_logprobs(runner: ModelRunner, ids: list[int], chunk: int) -> torch.Tensor:
    """Logprobs [len(ids) - 1] of ids[1:] under the runner's model (warmed
    up, idle), prefilled `chunk` tokens a step: the later chunks read the
    earlier ones from the KV cache."""
    steps = [pb.StepRequest(new_sequences=[pb.NewSequence(
        id=1, token_ids=ids, prompt_length=len(ids), num_scheduled_tokens=min(chunk, len(ids)),
        block_table=list(range(-(-len(ids) // runner.block_size))),
        parameters=pb.SamplingParameters(prefill_logprobs=True))])]
    steps += [pb.StepRequest(running=[pb.RunningSequence(id=1, num_scheduled_tokens=min(chunk, len(ids) - start))])
              for start in range(chunk, len(ids), chunk)]
    logprobs = [t.logprob for step in steps for t in runner.step(step).generations[0].prefill_tokens]
    runner.step(pb.StepRequest(release_ids=[1]))
    return torch.tensor(logprobs[1:])  # the first token has none


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's threads for work started inside, in this thread and in threads
    that make their first parallel op inside (an InProcessShard's loads its
    model here and serves on its own thread). An in-process shard runs without
    a shard process's thread governor (tgi_server/thread_governor.py): beside
    busy cores its two OpenMP threads wait on each other in every parallel
    region. On two cores shared with other tests, a tiny model's decode
    forward took 76 ms with two threads, 0.5 ms with one; loading SmolLM2
    (its int4 packing) 13-18 s with two, 2-3 s with one. The count never
    changes a result (the kernels never split a summed dimension)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class DraftAlways(SpeculationPolicy):
    """Lets every decoding sequence draft the most, every step (tests of
    exactness want drafts checked, whatever they cost)."""

    def drafts(self, decoding, batch):
        return {s.id: self.max_drafts for s in decoding}


def greedy(**kw) -> pb.SamplingParameters:
    return pb.SamplingParameters(**kw)


class InProcessShard:
    """Serves a shard on a background event loop; `socket` is its UDS path."""

    def __init__(self, tmp_path: Path, model_id: str | None, dtype: str = "float32",
                 kv_cache_bytes: int = 64 << 20, block_size: int = 16, backend: str | None = None,
                 lora_adapters: str | None = None, quantize: str | None = None,
                 cuda_graphs: tuple[int, ...] = (), speculative_model: str | None = None):
        self.config = ShardConfig(
            model_id=model_id, revision=None, uds_path=str(tmp_path / "shard"), dtype=dtype,
            device="cpu", block_size=block_size, kv_cache_bytes=kv_cache_bytes,
            attention_backend=backend, num_threads=0, lora_adapters=lora_adapters, quantize=quantize,
            cuda_graphs=cuda_graphs, speculative_model=speculative_model)
        self.runner, self.info = load_shard(self.config)
        self.socket = self.config.socket_path
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self):
        asyncio.set_event_loop(self._loop)
        ready = asyncio.Event()
        self._task = self._loop.create_task(serve(self.runner, self.info, self.socket, ready))
        self._loop.create_task(self._signal(ready))
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass

    async def _signal(self, ready: asyncio.Event):
        await ready.wait()
        self._ready.set()

    def __enter__(self) -> "InProcessShard":
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("shard did not start")
        return self

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(10)


class ShardProcesses:
    """`text-generation-server serve` once per rank, with the environment the
    launcher gives it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); on CPU
    the group talks over gloo. `sockets` are in rank order; `log(rank)` is a
    shard's stdout so far. kv_cache_bytes: each rank's cache, as in
    InProcessShard (the shard's own default, a share of the host's memory,
    is gigabytes zeroed at every Warmup: 1-4 s a call)."""

    def __init__(self, tmp_path: Path, model_id: str, world_size: int, *args: str,
                 dtype: str = "float32", device: str = "cpu", num_threads: int = 1,
                 kv_cache_bytes: int = 64 << 20):
        self.tmp_path, self.world_size = tmp_path, world_size
        uds = str(tmp_path / f"tp{world_size}")
        self.sockets = [f"{uds}-{rank}" for rank in range(world_size)]
        port = free_port()
        self.processes: list[subprocess.Popen] = []
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
            with open(self._log_path(rank), "w") as out:
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-m", "tgi_server.cli", "serve", model_id, "--uds-path", uds,
                     "--dtype", dtype, "--device", device, "--num-threads", str(num_threads),
                     "--kv-cache-bytes", str(kv_cache_bytes), *args],
                    env=env, stdout=out, stderr=subprocess.STDOUT))

    def _log_path(self, rank: int) -> Path:
        return self.tmp_path / f"tp{self.world_size}-rank{rank}.log"

    def log(self, rank: int) -> str:
        return self._log_path(rank).read_text()

    def __enter__(self) -> "ShardProcesses":
        deadline = time.monotonic() + 120
        try:
            for rank, path in enumerate(self.sockets):
                while not os.path.exists(path):
                    if self.processes[rank].poll() is not None:
                        raise RuntimeError(f"shard {rank} exited: {self.log(rank)[-2000:]}")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"shard {rank} did not start: {self.log(rank)[-2000:]}")
                    time.sleep(0.05)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for p in self.processes:
            if p.poll() is None:
                p.terminate()
        for p in self.processes:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


async def run_prompts(socket: str | list[str], prompts: list[list[int]], max_new_tokens: int,
                      params: list[pb.SamplingParameters] | None = None, stop_ids=(),
                      max_batch_tokens: int = 4096, arrivals: list[int] | None = None,
                      warmup_tokens: int = 256, stats: dict | None = None,
                      prefix_caching: bool = True, adapters: list[int] | None = None,
                      speculation: SpeculationPolicy | None = None, warmup: bool = True) -> list[Sequence]:
    """Generates for every prompt in one continuous batch over gRPC, on one
    shard or on every rank of a group (`socket` a list, in rank order).

    arrivals[i] is the step at which prompt i joins (staggered arrivals).
    stats, when given, receives the preemptions and prefix-cache hit tokens.
    adapters[i]: the LoRA adapter of prompt i (0: the base model).
    speculation: the scheduler's draft policy (None: no speculation).
    warmup False: the shards were warmed up by an earlier call, whose cache
    this one reuses (its blocks from Info); a Warmup on the CPU compiles the
    decode steps again (seconds for SmolLM2)."""
    client = ShardClient([socket] if isinstance(socket, str) else socket, timeout=120)
    try:
        warm = await (client.warmup(warmup_tokens, 64) if warmup else client.info())
        scheduler = Scheduler(BlockManager(warm.num_blocks, warm.block_size, prefix_caching), max_batch_tokens,
                              speculation=speculation)
        engine = Engine(client, scheduler)
        seqs = [Sequence(id=i + 1, token_ids=list(p), params=(params or [greedy()] * len(prompts))[i],
                         stopping=StoppingCriteria(max_new_tokens, frozenset(stop_ids)),
                         adapter=adapters[i] if adapters else 0)
                for i, p in enumerate(prompts)]
        pending = sorted(zip(arrivals or [0] * len(seqs), range(len(seqs))))
        step = 0
        while pending or not engine.idle:
            while pending and pending[0][0] <= step:
                scheduler.add(seqs[pending.pop(0)[1]])
            await engine.step()
            step += 1
        if stats is not None:
            stats["preemptions"] = scheduler.num_preemptions
            stats["hit_tokens"] = scheduler.take_stats().hit_tokens
        return seqs
    finally:
        await client.close()


def save_tiny_tokenizer(path: Path) -> None:
    """A byte-level BPE over the 256 bytes plus <s>=256, </s>=257 (no
    merges): every UTF-8 byte is a token, so multi-byte characters span
    several tokens. Pair it with a model of vocab_size >= 258."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    fast.save_pretrained(path)


def save_tiny_served_model(path: Path, seed: int = 0, eos_token_id: int | None = 257, **overrides) -> Path:
    """A tiny llama with a tokenizer: what the router needs to serve text.
    eos_token_id None: the model never stops early (for long generations);
    overrides: other config fields (head counts for tensor parallelism)."""
    save_tiny_model("llama", path, seed=seed, vocab_size=320, bos_token_id=256, eos_token_id=eos_token_id,
                    **overrides)
    save_tiny_tokenizer(path)
    return path
