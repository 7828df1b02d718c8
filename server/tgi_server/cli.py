"""`text-generation-server serve MODEL --uds-path PATH`: one shard process."""

import argparse
import asyncio
import logging
import os
import sys

from .config import ShardConfig

log = logging.getLogger("tgi_server")


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of bytes, got {text!r}")
    return value


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
    # Bytes only: the launcher parses sizes such as 2GiB (tgi_router.config).
    serve.add_argument("--kv-cache-bytes", type=non_negative, default=0,
                       help="KV cache budget in bytes; 0 = a share of free memory at Warmup")
    serve.add_argument("--attention-backend", default=os.environ.get("TGI_ATTENTION_BACKEND") or None,
                       help="reference, sdpa or flash_attn (env TGI_ATTENTION_BACKEND)")
    serve.add_argument("--num-threads", type=int, default=0, help="torch threads on CPU (0 = torch default)")
    serve.add_argument("--json-output", action="store_true", help="log JSON lines")
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
        attention_backend=args.attention_backend, num_threads=args.num_threads,
        rank=rank, world_size=world_size, master_addr=os.environ.get("MASTER_ADDR", "localhost"),
        master_port=int(os.environ.get("MASTER_PORT", "29500")))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    _setup_logging(args.json_output)
    config = config_from_args(args)
    from .distributed import TensorParallelError
    from .shard import load_shard, run_shard
    from .weights.errors import CheckpointError

    try:
        runner, info = load_shard(config)
    except (CheckpointError, TensorParallelError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    try:
        asyncio.run(run_shard(runner, info, config.socket_path))
    except KeyboardInterrupt:
        pass


def _setup_logging(json_output: bool) -> None:
    fmt = ('{"time":"%(asctime)s","level":"%(levelname)s","target":"%(name)s","message":"%(message)s"}'
           if json_output else "%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Logs go to stdout; stderr carries only a fatal one-line error.
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO").upper(), format=fmt, stream=sys.stdout)


if __name__ == "__main__":
    main()
