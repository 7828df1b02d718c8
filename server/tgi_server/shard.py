"""Assembles a shard from its config: model, runner, Info; then serves it."""

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import time

import torch

from tgi_proto import pb

from .config import ShardConfig
from .distributed import TensorParallel
from .layers.attention import Attention
from .model_loader import DTYPES, default_dtype, default_quant_kernel_dtype, load_model, open_checkpoint
from .model_runner import ModelRunner
from .quant import kernel_counts
from .sampling.grammar import GrammarCompiler
from .sampling.watermark import Watermark
from .service import serve
from .speculation.medusa import HEADS_FILE, MedusaHeads, medusa_config
from .thread_governor import ThreadGovernor
from .weights.resolve import resolve_model
from .weights.tokenizer_export import export_tokenizer

log = logging.getLogger("tgi_server")

KV_CACHE_DTYPES = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}  # --kv-cache-dtype


def pick_device(name: str | None, rank: int = 0) -> torch.device:
    """`name`, or CUDA when available, else the CPU; a CUDA device without an
    index is this rank's GPU, cuda:{rank}."""
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    if device.index is None:
        if rank >= torch.cuda.device_count():
            raise ValueError(f"shard {rank} needs cuda:{rank} but only {torch.cuda.device_count()} "
                             "CUDA devices are visible")
        device = torch.device("cuda", rank)
    return device


def load_shard(config: ShardConfig) -> tuple[ModelRunner, pb.InfoResponse]:
    """Loads this rank's slice of the model. A model that does not split over
    the world size fails (ValueError) before any weight is read and before
    the group forms."""
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    device = pick_device(config.device, config.rank)
    dtype = DTYPES[config.dtype] if config.dtype else default_dtype(device)
    kernel_dtype = None if config.dtype else default_quant_kernel_dtype(device, dtype)
    source = resolve_model(config.model_id, config.revision)
    medusa_dir = source.path
    medusa = medusa_config(source.path) if source.format == "safetensors" else None
    if medusa is not None and not any(f.name != HEADS_FILE for f in source.path.glob("*.safetensors")):
        # A Medusa repository holds the heads; the weights are its base model's.
        if not medusa.get("base_model_name_or_path"):
            raise ValueError(f"{source.path}: Medusa heads without weights or a base_model_name_or_path")
        source = dataclasses.replace(resolve_model(medusa["base_model_name_or_path"], None), model_id=source.model_id)
    log.info("loading %s (%s) as %s on %s", source.model_id, source.path, str(dtype).removeprefix("torch."), device)
    start = time.perf_counter()
    kv_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] if config.kv_cache_dtype else None
    c, weights = open_checkpoint(source, dtype, device, config.quantize, kernel_dtype, config.rope,
                                 config.lora_adapters, kv_scales=kv_dtype is not None)
    if config.rope:
        log.info("RoPE scaling %s at factor %g replaces the checkpoint's: the model serves %d positions",
                 *config.rope, c.max_position_embeddings)
    c.check_tensor_parallel(config.world_size)
    tp = TensorParallel.connect(config.rank, config.world_size, config.master_addr, config.master_port, device)
    loaded = load_model(c, weights, tp)
    tokenizer_json, tokenizer_config_json = export_tokenizer(source)
    # Rank 0 alone samples, so it alone compiles grammars.
    grammars = (GrammarCompiler(tokenizer_json, c.vocab_size, c.eos_token_ids)
                if tokenizer_json and tp.rank == 0 else None)
    runner = ModelRunner(loaded, config.block_size, config.attention_backend, config.kv_cache_bytes, grammars,
                         config.cuda_graphs, config.cuda_memory_fraction,
                         Watermark(config.watermark_gamma, config.watermark_delta), kv_dtype)
    heads = loaded.model.heads
    log.info("loaded %s: %d layers in %.1f s; attention backend %s; shard %d of %d holds %d of %d query "
             "heads, %d of %d kv heads, %.1f MiB of weights (%d bytes)",
             c.model_type, c.num_layers, time.perf_counter() - start, runner.backend, tp.rank, tp.world_size,
             heads.num_heads, c.num_heads, heads.num_kv_heads, c.num_kv_heads,
             loaded.weight_bytes / 2**20, loaded.weight_bytes)
    if config.speculative_model:
        _attach_draft(runner, config, dtype, kernel_dtype, tp, tokenizer_json, kv_dtype)
    elif medusa is not None:
        runner.medusa = MedusaHeads(medusa_dir, medusa, c.vocab_size, dtype, device)
        log.info("Medusa heads: %d, %d residual blocks each", runner.medusa.num_heads, runner.medusa.num_layers)
    if kv_dtype is not None:
        scaled = sum(1 for m in loaded.model.modules() if isinstance(m, Attention) and m.kv_scaled)
        log.info("KV cache blocks in %s: %d of %d layers with the checkpoint's k/v scales, the others 1.0",
                 config.kv_cache_dtype, scaled, c.num_layers)
    if kernels := kernel_counts(loaded.model):
        log.info("quantized linears by kernel: %s%s", ", ".join(f"{n} {name}" for name, n in sorted(kernels.items())),
                 f" (activations in {str(kernel_dtype).removeprefix('torch.')})" if kernel_dtype else "")
    info = pb.InfoResponse(
        model_id=source.model_id, model_type=c.model_type, dtype=str(dtype).removeprefix("torch."),
        device=str(device), block_size=config.block_size, max_position_embeddings=c.max_position_embeddings,
        vocab_size=c.vocab_size, eos_token_ids=list(c.eos_token_ids), num_layers=c.num_layers,
        num_kv_heads=heads.num_kv_heads, head_dim=c.head_dim,
        sliding_window=max(layer.sliding_window for layer in c.layers),
        attention_backend=runner.backend, rank=tp.rank, world_size=tp.world_size,
        bos_token_id=c.bos_token_id if c.bos_token_id is not None else 0,
        tokenizer_json=tokenizer_json, tokenizer_config_json=tokenizer_config_json,
        adapter_ids=loaded.adapters.names if loaded.adapters is not None else [],
        medusa_heads=runner.medusa.num_heads if runner.medusa is not None else 0)
    return runner, info


def _attach_draft(runner: ModelRunner, config: ShardConfig, dtype: torch.dtype, kernel_dtype: torch.dtype | None,
                  tp: TensorParallel, tokenizer_json: str, kv_dtype: torch.dtype | None) -> None:
    """Loads --speculative-model as the runner's draft model, on the target's
    device, dtype and group; refuses one whose vocabulary is not the target's
    (its token ids would mean other text)."""
    source = resolve_model(config.speculative_model, None)
    start = time.perf_counter()
    c, weights = open_checkpoint(source, dtype, runner.device, quant_kernel_dtype=kernel_dtype)
    draft_tokenizer, _ = export_tokenizer(source)
    if not same_vocabulary(tokenizer_json, draft_tokenizer):
        raise ValueError(f"the speculative model {source.model_id} does not share the model's tokenizer: "
                         "its drafts would be other tokens")
    c.check_tensor_parallel(tp.world_size)
    loaded = load_model(c, weights, tp)
    runner.attach_draft(loaded, kv_dtype)
    log.info("speculative model %s (%s): %d layers, %.1f MiB of weights, loaded in %.1f s", source.model_id,
             c.model_type, c.num_layers, loaded.weight_bytes / 2**20, time.perf_counter() - start)


def same_vocabulary(a: str, b: str) -> bool:
    """Whether two `tokenizers` JSON texts map the same strings to the same ids
    (their model vocabularies and added tokens); empty texts never match."""
    if not a or not b:
        return False
    ja, jb = json.loads(a), json.loads(b)

    def ids(j: dict) -> tuple:
        vocab = j.get("model", {}).get("vocab")
        added = sorted((t["id"], t["content"]) for t in j.get("added_tokens", []))
        return json.dumps(vocab, sort_keys=True), tuple(added)
    return ids(ja) == ids(jb)


async def run_shard(runner: ModelRunner, info: pb.InfoResponse, socket_path: str) -> None:
    """Serves until SIGTERM/SIGINT, then removes the socket."""
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    task = asyncio.ensure_future(serve(runner, info, socket_path))
    # On the CPU the OpenMP threads follow the cores other processes leave
    # free (thread_governor.py); TGI_THREAD_GOVERNOR=0 keeps them fixed.
    governor = (asyncio.ensure_future(ThreadGovernor(torch.get_num_threads()).run())
                if runner.device.type == "cpu" and os.environ.get("TGI_THREAD_GOVERNOR", "1") != "0" else None)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        log.info("shard %d stopping", info.rank)
    finally:
        if governor is not None:
            governor.cancel()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
        runner.tp.close()
