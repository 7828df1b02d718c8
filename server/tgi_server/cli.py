"""`text-generation-server serve MODEL --uds-path PATH`: one shard process.
`text-generation-server quantize MODEL OUT --method gptq|awq`: writes a
quantized checkpoint."""

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from .config import ShardConfig

QUANTIZE_METHODS = ("gptq", "awq", "eetq")  # quant.METHODS, without importing torch to parse flags
ROPE_SCALINGS = ("linear", "dynamic", "yarn")  # what models/rope_override.py serves
KV_CACHE_DTYPES = ("fp8_e4m3fn", "fp8_e5m2")  # shard.KV_CACHE_DTYPES' names

log = logging.getLogger("tgi_server")


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of bytes, got {text!r}")
    return value


def batch_sizes(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4); '' or '0' -> ()."""
    try:
        sizes = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected batch sizes such as 1,2,4, got {text!r}") from None
    return tuple(n for n in sizes if n > 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="text-generation-server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve one shard of a model over gRPC on a unix socket")
    serve.add_argument("model_id", nargs="?", default=None,
                       help="local directory, .gguf file or hub id in the HF cache (default: SmolLM2-135M-Instruct)")
    serve.add_argument("--revision", default=None)
    serve.add_argument("--uds-path", default="/tmp/text-generation-server")
    serve.add_argument("--dtype", choices=["float64", "float32", "bfloat16", "float16"], default=None)
    serve.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    serve.add_argument("--block-size", type=int, default=16)
    # Bytes only: the launcher parses sizes such as 2GiB (tgi_router.launch.config).
    serve.add_argument("--kv-cache-bytes", type=non_negative, default=0,
                       help="KV cache budget in bytes; 0 = a share of free memory at Warmup")
    serve.add_argument("--attention-backend", default=os.environ.get("TGI_ATTENTION_BACKEND") or None,
                       help="reference, sdpa, cpu, flash_attn or triton (env TGI_ATTENTION_BACKEND)")
    serve.add_argument("--cuda-graphs", type=batch_sizes, default=None,
                       help="decode batch sizes captured as CUDA graphs at Warmup, e.g. 1,2,4,8; on the CPU "
                            "compiled by torch.compile instead (TGI_CPU_COMPILE=0: eager); 0: none "
                            "(default: 1,2,4,8,16,32 on CUDA, 1,2,4,8,16,32,64 on the CPU)")
    serve.add_argument("--num-threads", type=int, default=0, help="torch threads on CPU (0 = torch default)")
    serve.add_argument("--quantize", choices=QUANTIZE_METHODS, default=None,
                       help="gptq | awq | eetq (default: config.json's quantization_config)")
    serve.add_argument("--rope-scaling", choices=ROPE_SCALINGS, default=None,
                       help="RoPE scaling replacing the checkpoint's (with --rope-factor; the launcher "
                            "pairs TGI's flags)")
    serve.add_argument("--rope-factor", type=float, default=None, help="RoPE scaling factor (> 0)")
    serve.add_argument("--cuda-memory-fraction", type=float, default=1.0,
                       help="share of the GPU's memory the shard may hold when Warmup sizes the KV cache")
    serve.add_argument("--watermark-gamma", type=float, default=0.5,
                       help="green share of the vocabulary for watermarked requests (0, 1)")
    serve.add_argument("--watermark-delta", type=float, default=2.0, help="bias added to green logits")
    serve.add_argument("--lora-adapters", default=os.environ.get("LORA_ADAPTERS") or None,
                       help="LoRA adapters: comma-separated hub ids or local directories, or name=path "
                            "(env LORA_ADAPTERS)")
    serve.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                       help="float8 KV cache blocks (twice the tokens of 16-bit ones; default: the model's dtype)")
    serve.add_argument("--speculative-model", default=None,
                       help="draft model for speculation (same tokenizer; default: n-gram drafts)")
    serve.add_argument("--json-output", action="store_true", help="log JSON lines")
    quantize = sub.add_parser("quantize", help="write a GPTQ or AWQ checkpoint of a float model")
    quantize.add_argument("model_id", help="local directory, .gguf file or hub id in the HF cache")
    quantize.add_argument("output_dir", type=Path)
    quantize.add_argument("--method", choices=["gptq", "awq"], required=True)
    quantize.add_argument("--bits", type=int, choices=[4, 8], default=4)
    quantize.add_argument("--group-size", type=int, default=128, help="input columns per scale (-1: per row)")
    quantize.add_argument("--act-order", action="store_true", help="GPTQ: quantize columns by activation order")
    quantize.add_argument("--sym", action="store_true", help="GPTQ: symmetric groups (default: asymmetric)")
    quantize.add_argument("--samples", dest="calibration_sequences", type=int, default=64,
                          help="calibration sequences")
    quantize.add_argument("--seq-len", type=int, default=128, help="tokens per calibration sequence")
    quantize.add_argument("--calibration", default="stdlib",
                          help="stdlib (Python's docstrings, default), generated (sampled by the model) "
                               "or a text file")
    quantize.add_argument("--seed", type=int, default=0)
    quantize.add_argument("--num-threads", type=int, default=0, help="torch threads (0 = torch default)")
    detect = sub.add_parser("watermark-detect", help="z-score of a text's watermark (one JSON line); exit 0 "
                                                      "when it is watermarked (z > 4), 1 when not")
    detect.add_argument("text", nargs="?", default=None, help="the text (default: read from stdin)")
    detect.add_argument("--model-id", default=None, help="the model that wrote it (default: SmolLM2-135M-Instruct)")
    detect.add_argument("--watermark-gamma", type=float, default=0.5, help="the server's --watermark-gamma")
    return parser


def config_from_args(args: argparse.Namespace) -> ShardConfig:
    if args.block_size < 1 or args.block_size & (args.block_size - 1):
        raise SystemExit("error: --block-size must be a power of two")
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if not 0 <= rank < world_size:
        raise SystemExit(f"error: RANK={rank} is not a rank of WORLD_SIZE={world_size}")
    return ShardConfig(
        model_id=args.model_id, revision=args.revision, uds_path=args.uds_path, dtype=args.dtype,
        device=args.device, block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes,
        attention_backend=args.attention_backend, num_threads=args.num_threads, quantize=args.quantize,
        rank=rank, world_size=world_size, master_addr=os.environ.get("MASTER_ADDR", "localhost"),
        master_port=int(os.environ.get("MASTER_PORT", "29500")), cuda_graphs=args.cuda_graphs,
        rope=_rope(args.rope_scaling, args.rope_factor), cuda_memory_fraction=_fraction(args.cuda_memory_fraction),
        watermark_gamma=_gamma(args.watermark_gamma), watermark_delta=args.watermark_delta,
        lora_adapters=args.lora_adapters, kv_cache_dtype=args.kv_cache_dtype,
        speculative_model=args.speculative_model)


def _gamma(value: float) -> float:
    if not 0 < value < 1:
        raise SystemExit("error: --watermark-gamma must be in (0, 1)")
    return value


def _fraction(value: float) -> float:
    if not 0 < value <= 1:
        raise SystemExit("error: --cuda-memory-fraction must be in (0, 1]")
    return value


def _rope(scaling: str | None, factor: float | None) -> tuple[str, float] | None:
    if (scaling is None) != (factor is None):
        raise SystemExit("error: --rope-scaling and --rope-factor go together")
    if factor is not None and not factor > 0:
        raise SystemExit("error: --rope-factor must be > 0")
    return None if scaling is None else (scaling, factor)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "quantize":
        _quantize(args)
        return
    if args.command == "watermark-detect":
        _watermark_detect(args)
    _setup_logging(args.json_output)
    config = config_from_args(args)
    from .distributed import TensorParallelError
    from .shard import load_shard, run_shard
    from .weights.errors import CheckpointError

    try:
        runner, info = load_shard(config)
    except (CheckpointError, TensorParallelError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        _exit(1)
    try:
        asyncio.run(run_shard(runner, info, config.socket_path))
    except KeyboardInterrupt:
        pass
    _exit(0)


def _exit(code: int) -> NoReturn:
    """Ends the shard process without the interpreter's teardown, which
    spends ~0.7 s garbage-collecting torch's modules at every stop (a
    launcher waits for its shards): what must outlive it is flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _quantize(args: argparse.Namespace) -> None:
    import torch

    from .quant.quantizer import quantize_model
    from .weights.errors import CheckpointError

    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    try:
        quantize_model(args.model_id, args.output_dir, args.method, bits=args.bits, group_size=args.group_size,
                       act_order=args.act_order, symmetric=args.sym,
                       calibration_sequences=args.calibration_sequences, length=args.seq_len, seed=args.seed,
                       calibration=args.calibration)
    except (CheckpointError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


def _watermark_detect(args: argparse.Namespace) -> NoReturn:
    from .sampling.watermark_detect import detect, load_scorer
    from .weights.errors import CheckpointError

    gamma = _gamma(args.watermark_gamma)
    try:
        load_scorer(args.model_id)  # before the text: what writes it to a pipe need not wait for the tokenizer
        text = args.text if args.text is not None else sys.stdin.read()
        result = detect(args.model_id, text, gamma)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(result))
    sys.exit(0 if result["watermarked"] else 1)


def _setup_logging(json_output: bool) -> None:
    fmt = ('{"time":"%(asctime)s","level":"%(levelname)s","target":"%(name)s","message":"%(message)s"}'
           if json_output else "%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Logs go to stdout; stderr carries only a fatal one-line error.
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO").upper(), format=fmt, stream=sys.stdout)


if __name__ == "__main__":
    main()
