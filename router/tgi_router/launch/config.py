"""The launcher's configuration: TGI's flags (launcher/src/main.rs `Args`), each
also read from the environment variable of the same name in upper snake case
(flags win), validated once into the frozen `RouterConfig`.

Defaults are TGI's except `model_id` (none: the shard serves SmolLM2-135M-
Instruct). Limits TGI derives from the model and the KV cache are left `None`
here and resolved by `resolve_limits` once the shards have answered Info and
Warmup. A bad value or combination raises `ConfigError` with a one-line message
(TGI's own where it has one); the launcher prints it and exits 2.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Callable

# TGI: float16, bfloat16. Ours: float32 for CPUs without bf16, float64 for exact
# comparisons across configurations (tensor-parallel ranks sum in another order).
from tgi_router.text.reasoning import STYLES as REASONING_STYLES

DTYPES = ("float16", "bfloat16", "float32", "float64")
QUANTIZE = ("awq", "compressed-tensors", "eetq", "exl2", "gptq", "marlin", "bitsandbytes",
            "bitsandbytes-nf4", "bitsandbytes-fp4", "fp8")
QUANTIZE_SERVED = ("awq", "eetq", "gptq")    # the rest are TGI's choices we do not implement
ROPE_SCALINGS = ("linear", "dynamic", "yarn")  # TGI: linear, dynamic; ours: yarn too
KV_CACHE_DTYPES = ("fp8_e4m3fn", "fp8_e5m2")  # TGI's --kv-cache-dtype values
MAX_SPECULATE = 32  # --speculate: more drafts than this are never accepted often enough to pay
DRAFT_MODEL_SPECULATE = 4  # --speculate's default with --speculative-model


class ConfigError(ValueError):
    """A bad flag, environment value or combination; the message is one line."""


@dataclass(frozen=True)
class RouterConfig:
    """Everything the launcher, router and shards are started with. `None`
    limits are derived by `resolve_limits`; `num_shard` is already resolved."""
    model_id: str | None = None
    revision: str | None = None
    dtype: str | None = None
    sharded: bool | None = None
    num_shard: int = 1
    quantize: str | None = None
    trust_remote_code: bool = False
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_client_batch_size: int = 4
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    waiting_served_ratio: float = 0.3
    max_batch_prefill_tokens: int | None = None
    max_batch_total_tokens: int | None = None
    max_waiting_tokens: int = 20
    max_batch_size: int | None = None
    hostname: str = "0.0.0.0"
    port: int = 3000
    shard_uds_path: str = "/tmp/text-generation-server"
    master_addr: str = "localhost"
    master_port: int = 29500
    huggingface_hub_cache: str | None = None
    json_output: bool = False
    cors_allow_origin: tuple[str, ...] = ()
    api_key: str | None = None
    payload_limit: int = 2_000_000
    tokenizer_config_path: str | None = None
    graceful_termination_timeout: int = 90      # seconds
    flash_attention: bool = False  # refuse to start without a flash-style attention backend
    disable_grammar_support: bool = False
    # Decode batch sizes captured on CUDA (compiled on CPUs); (): none; None:
    # the device's default, chosen by the shard (TGI's 1..32 on CUDA, 1..64 on CPUs).
    cuda_graphs: tuple[int, ...] | None = None
    rope_scaling: str | None = None  # overrides the checkpoint's RoPE scaling (with rope_factor)
    rope_factor: float | None = None
    cuda_memory_fraction: float = 1.0  # of each GPU's memory a shard may hold (KV cache sized at Warmup)
    lora_adapters: str | None = None  # "id,name=path,...": LoRA adapters the shards load
    otlp_endpoint: str | None = None  # OTLP/gRPC collector for the router's trace spans; None: no tracing
    otlp_service_name: str = "text-generation-inference.router"
    watermark_gamma: float | None = None  # None: the shard's default, 0.5 (TGI's)
    watermark_delta: float | None = None  # None: 2.0
    kv_cache_dtype: str | None = None  # fp8_e4m3fn | fp8_e5m2: float8 KV blocks; None: the model's dtype
    speculate: int | None = None  # most drafts per sequence and step; 0: none; None: the Medusa heads' count, if any
    speculative_model: str | None = None  # ours: drafts from this model (same tokenizer) instead of n-grams
    # Ours, not TGI's.
    kv_cache_bytes: int = 0        # KV cache budget passed to each shard; 0: sized at Warmup
    num_threads: int = 0           # torch threads per shard on CPU; 0: torch's default
    step_timeout: float = 120.0    # seconds a shard may take for one step before it counts as hung; 0: none
    max_stall_ratio: float = 0.0   # a step with prompt tokens beside decodes vs a decode-only step; 0: no bound
    request_read_timeout: float = 60.0  # seconds a request (headers and body) may take to arrive; 0: none
    protect_metrics: bool = False  # with --api-key, /metrics and /info need the key too
    reasoning_parser: str | None = None  # "qwen3" | "deepseek_r1": thoughts as reasoning_content
    disable_playground: bool = False  # no chat page at GET / for browsers
    log_level: str = "info"        # env LOG_LEVEL, as TGI
    prefix_caching: bool = True    # env PREFIX_CACHING=0 (or false) turns it off, as TGI; no flag
    ignored_flags: tuple[str, ...] = ()  # TGI flags accepted without effect here


# -- value parsers: raise ValueError with the reason ---------------------------

def _count(text: str, limit: int | None = None) -> int:
    if not text.strip().isdigit() or (limit is not None and int(text) > limit):
        raise ValueError(f"expected an integer from 0 to {limit}" if limit else "expected a non-negative integer")
    return int(text)


def _float(text: str) -> float:
    if not math.isfinite(value := float(text)):  # ValueError on text that is no number
        raise ValueError("expected a finite number")
    return value


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        raise ValueError("expected true or false")
    return value in ("true", "1", "yes", "on")


def _size(text: str) -> int:
    """'0', '4096', '512MiB', '2GiB', '1.5GB' -> bytes."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    t = text.strip().lower()
    number = t.rstrip("kmgib")
    try:
        value = int(float(number) * units[t[len(number):]])
    except (KeyError, ValueError):
        value = -1
    if value < 0:
        raise ValueError("expected a size such as 4096, 512MiB or 2GiB")
    return value


def _batch_sizes(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4), sorted and unique; '0' -> () (TGI's way to turn CUDA graphs off)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError("expected batch sizes such as 1,2,4,8, or 0")
    sizes = sorted({int(p) for p in parts})
    return () if sizes == [0] else tuple(n for n in sizes if n > 0)


def _choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"possible values: {', '.join(choices)}")
        return text
    return parse


@dataclass(frozen=True)
class _Flag:
    name: str                              # attribute; --name-with-dashes; env NAME
    parse: Callable[[str], Any] | None     # None: a switch without a value
    help: str
    aliases: tuple[str, ...] = ()


_FLAGS = (
    _Flag("model_id", str, "directory, .gguf file or hub id (default: SmolLM2-135M-Instruct)", ("--model",)),
    _Flag("revision", str, "hub revision: a commit id or a branch such as refs/pr/2"),
    _Flag("dtype", _choice(DTYPES), f"dtype forced on the model: {', '.join(DTYPES)}"),
    _Flag("sharded", _bool, "shard the model over every visible GPU (true/false)"),
    _Flag("num_shard", _count, "number of tensor-parallel shards (default: visible GPUs, else 1)"),
    _Flag("quantize", _choice(QUANTIZE), "quantization: gptq, awq, eetq (default: config.json's "
          "quantization_config)"),
    _Flag("trust_remote_code", None, "accepted for compatibility: no hub code is ever run"),
    _Flag("max_concurrent_requests", _count, "requests in flight before 429 (default: 128)"),
    _Flag("max_best_of", _count, "largest best_of a client may ask for (default: 2)"),
    _Flag("max_client_batch_size", _count, "most prompts one /v1/completions request may hold (default: 4)"),
    _Flag("max_stop_sequences", _count, "most stop sequences per request (default: 4)"),
    _Flag("max_top_n_tokens", _count, "largest top_n_tokens (default: 5)"),
    _Flag("max_input_tokens", _count, "longest prompt in tokens (default: max_total_tokens - 1)"),
    _Flag("max_input_length", _count, "legacy name of --max-input-tokens"),
    _Flag("max_total_tokens", _count, "prompt + new tokens (default: min(KV cache, model length))"),
    _Flag("waiting_served_ratio", _float, "waiting/running ratio to join the batch (default: 0.3)"),
    _Flag("max_batch_prefill_tokens", _count, "tokens per step (default: min(4096, model length))"),
    _Flag("max_batch_total_tokens", _count, "tokens in the batch (default: what the KV cache holds)"),
    _Flag("max_waiting_tokens", _count, "steps before waiting requests must join (default: 20)"),
    _Flag("max_batch_size", _count, "most requests per batch (default: no limit)"),
    _Flag("hostname", str, "address to listen on (default: 0.0.0.0)"),
    _Flag("port", lambda t: _count(t, 65535), "port to listen on (default: 3000)", ("-p",)),
    _Flag("shard_uds_path", str, "shard sockets are {path}-{rank} (default: /tmp/text-generation-server)"),
    _Flag("master_addr", str, "torch.distributed master address (default: localhost)"),
    _Flag("master_port", lambda t: _count(t, 65535), "torch.distributed master port (default: 29500)"),
    _Flag("huggingface_hub_cache", str, "Hugging Face hub cache directory for the shards"),
    _Flag("json_output", None, "log JSON lines"),
    _Flag("cors_allow_origin", str, "an allowed CORS origin (repeatable)"),
    _Flag("api_key", str, "bearer token required on generation routes"),
    _Flag("payload_limit", _count, "largest request body in bytes (default: 2000000)"),
    _Flag("tokenizer_config_path", str, "tokenizer_config.json to use (e.g. for its chat_template)"),
    _Flag("graceful_termination_timeout", _count, "seconds to drain requests on SIGTERM (default: 90)"),
    _Flag("disable_grammar_support", None, "refuse grammars, response_format schemas and tools (422)"),
    _Flag("flash_attention", None,
          "require flash-style attention (flash-attn on CUDA; our C++ kernels or SDPA on CPU)"),
    _Flag("rope_scaling", _choice(ROPE_SCALINGS), "RoPE scaling replacing the checkpoint's: linear, dynamic "
          "or yarn (ours), with --rope-factor (default 1.0); the model's length grows by the factor"),
    _Flag("rope_factor", _float, "RoPE scaling factor; alone it means linear scaling"),
    _Flag("kv_cache_dtype", _choice(KV_CACHE_DTYPES), "KV cache blocks in float8: fp8_e4m3fn or fp8_e5m2, "
          "twice the tokens in the same memory (per-layer k/v scales from the checkpoint, else 1.0); on CUDA "
          "the triton attention backend becomes the default (default: the model's dtype)"),
    _Flag("speculate", lambda t: _count(t, MAX_SPECULATE), "speculative decoding: each decoding sequence "
          "may draft up to this many tokens per step, with the model's Medusa heads, --speculative-model, or "
          "else by n-gram lookup in its own prompt and output, checked in the same forward; the tokens are "
          "those decoding without drafts gives, and the scheduler drafts less as the batch grows (at most "
          f"{MAX_SPECULATE}; default: as many as the model has Medusa heads, else 0: off)"),
    _Flag("lora_adapters", str, "LoRA adapters to serve beside the base model: comma-separated hub ids or "
          "local PEFT directories, or name=path; a request picks one with parameters.adapter_id, or with "
          "`model` on the OpenAI routes"),
    _Flag("otlp_endpoint", str, "OTLP/gRPC collector (e.g. http://collector:4317) that receives a trace of "
          "each generation request: validation, queue, each step, the response (default: none)"),
    _Flag("otlp_service_name", str, "service.name of the exported spans (default: "
          "text-generation-inference.router)"),
    _Flag("watermark_gamma", _float, "share of the vocabulary in each green list of requests with "
          "\"watermark\": true (default: 0.5)"),
    _Flag("watermark_delta", _float, "bias added to the green logits of watermarked requests (default: 2.0)"),
    _Flag("cuda_memory_fraction", _float, "share of each GPU's memory a shard may hold: Warmup gives the KV "
          "cache what is free beyond (1 - fraction) of the total; no effect on CPU (default: 1.0)"),
    _Flag("cuda_graphs", _batch_sizes, "decode batch sizes captured as CUDA graphs at warmup, "
          "e.g. 1,2,4,8; on CPUs the same sizes run decode steps compiled by torch.compile (TGI_CPU_COMPILE=0: "
          "eager); 0 turns both off (default: 1,2,4,8,16,32; on CPUs 1,2,4,8,16,32,64, where a step "
          "of fewer rows than a size runs eagerly when Warmup measured its padding to cost more than "
          "compiling saves)"),
    # Ours.
    _Flag("speculative_model", str, "[ours] speculation drafts from this model (a directory, .gguf file or hub "
          "id that shares the model's tokenizer), run in each shard with its own K/V in the same blocks, "
          "instead of n-gram lookup; --speculate N drafts (default 4 with this flag)"),
    _Flag("kv_cache_bytes", _size, "[ours] KV cache budget per shard, e.g. 2GiB (default: sized at Warmup)"),
    _Flag("num_threads", _count, "[ours] torch threads per shard on CPU (default: torch's)"),
    _Flag("max_stall_ratio", _float, "[ours] prompt tokens in a step where sequences decode are bounded so "
          "that it takes at most this many times a decode-only step, from measured step times, e.g. 2.5 (default: 0, "
          "off: only --max-batch-prefill-tokens bounds them, as TGI)"),
    _Flag("step_timeout", _float, "[ours] seconds one step may take before the shard counts as hung: "
          "in-flight requests fail and the launcher exits 1 (default: 120; 0: no deadline)"),
    _Flag("request_read_timeout", _float, "[ours] seconds a request's headers and body may take to arrive "
          "before its connection is closed (408): slow clients cannot hold sockets (default: 60; 0: no deadline)"),
    _Flag("protect_metrics", None, "[ours] with --api-key, /metrics and /info need the key too "
          "(/health stays open)"),
    _Flag("reasoning_parser", _choice(REASONING_STYLES), "[ours] return a reasoning model's thoughts "
          "(between <think> and </think>) as reasoning_content on the chat routes: qwen3 or deepseek_r1"),
    _Flag("disable_playground", None, "[ours] serve no web playground: a browser's GET / answers 405, as TGI "
          "(default: a chat page at GET / for requests that prefer text/html)"),
)

# TGI flags that have no effect here: accepted (and logged) so that a TGI
# command line still starts. name -> (takes a value, why nothing changes).
_IGNORED = {
    "validation_workers": (True, "no effect: each request is validated in a worker thread as it arrives; "
                                 "there is no pool of tokenizer workers to size"),
    "weights_cache_override": (True, "no effect: TGI's Inference Endpoints weights path; weights come from "
                                     "--model-id or the Hugging Face cache (--huggingface-hub-cache)"),
    "disable_custom_kernels": (False, "no effect: TGI's switch for its CUDA extensions; ours are picked per "
                                      "attention backend (TGI_ATTENTION_BACKEND=sdpa runs plain torch)"),
    "usage_stats": (True, "no effect: no usage statistics are ever collected or sent"),
    "enable_prefill_logprobs": (False, "no effect: prompt logprobs are always available per request "
                                       "(decoder_input_details)"),
    "ngrok_authtoken": (True, "no effect: there is no built-in ngrok tunnel (see --ngrok)"),
    "ngrok_edge": (True, "no effect: there is no built-in ngrok tunnel (see --ngrok)"),
    "env": (False, "no effect: TGI's environment report; the launcher logs its configuration (Args ...) "
                   "at start-up instead"),
}
# TGI flags whose effect we cannot give: refused. name -> why.
_UNSUPPORTED = {
    "ngrok": "refused: there is no built-in ngrok tunnel; run ngrok (or any tunnel) beside the server",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block
        raise ConfigError(message)


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="text-generation-launcher", allow_abbrev=False,
                     argument_default=argparse.SUPPRESS,
                     description="Starts the model shards, then serves TGI's HTTP API.")
    for flag in _FLAGS:
        names = (_option(flag.name), *flag.aliases)
        help_text = f"{flag.help} [env: {flag.name.upper()}]"
        if flag.parse is None:
            parser.add_argument(*names, dest=flag.name, action="store_true", help=help_text)
        else:
            action = "append" if flag.name == "cors_allow_origin" else "store"
            parser.add_argument(*names, dest=flag.name, action=action, help=help_text,
                                type=_argparse_type(flag), metavar=flag.name.upper())
    for name, (takes_value, why) in _IGNORED.items():
        names = (_option(name), "-e") if name == "env" else (_option(name),)
        parser.add_argument(*names, dest=name, help=f"TGI flag, accepted with {why}",
                            **({"metavar": "VALUE"} if takes_value else {"action": "store_true"}))
    for name, why in _UNSUPPORTED.items():
        parser.add_argument(_option(name), dest=name, help=f"TGI flag, {why}",
                            **({"action": "store_true"} if name == "ngrok" else {"metavar": "VALUE"}))
    return parser


def _argparse_type(flag: _Flag) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return flag.parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: {err}") from None
    return convert


def parse_args(argv: list[str] | None, env: Mapping[str, str]) -> RouterConfig:
    """Flags first, then `env` (NAME for --name), then TGI's defaults.
    Raises ConfigError (one line) on a bad value or combination."""
    given = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    for flag in _FLAGS:
        if flag.name in given:
            values[flag.name] = given[flag.name]
        elif raw := env.get(flag.name.upper()):  # an empty variable counts as unset
            try:
                values[flag.name] = (flag.parse or _bool)(raw)
            except ValueError as err:
                raise ConfigError(f"invalid value {raw!r} for {flag.name.upper()}: {err}") from None
    for name in _UNSUPPORTED:
        value = given.get(name) or (env.get(name.upper()) if name != "ngrok" else None)
        if value:
            raise ConfigError(f"{_option(name)} is not supported yet")
    ignored = tuple(_option(n) for n in _IGNORED if n in given or (n != "env" and env.get(n.upper())))
    if isinstance(origins := values.get("cors_allow_origin"), (list, str)):
        values["cors_allow_origin"] = tuple([origins] if isinstance(origins, str) else origins)
    values["max_input_tokens"] = _max_input_tokens(values.pop("max_input_tokens", None),
                                                   values.pop("max_input_length", None))
    values["num_shard"] = _num_shard(values.get("sharded"), values.get("num_shard"), env)
    if "LOG_LEVEL" in env:  # TGI's filter ("debug", "text_generation_launcher=debug"): its level
        level = env["LOG_LEVEL"].strip().lower().rsplit("=", 1)[-1]
        level = {"warn": "warning", "trace": "debug"}.get(level, level)
        values["log_level"] = level if level in ("debug", "info", "warning", "error") else "info"
    values["prefix_caching"] = env.get("PREFIX_CACHING", "1").strip().lower() not in ("0", "false")
    if values.get("speculative_model") and "speculate" not in values:
        values["speculate"] = DRAFT_MODEL_SPECULATE
    known = {f.name for f in fields(RouterConfig)}
    config = RouterConfig(**{k: v for k, v in values.items() if k in known and v is not None},
                          ignored_flags=ignored)
    _validate(config)
    return config


def _max_input_tokens(tokens: int | None, length: int | None) -> int | None:
    if tokens is not None and length is not None:
        raise ConfigError(
            f"Both `max_input_tokens` ({tokens}) and `max_input_length` ({length}) are set. Please "
            "define only `max_input_tokens` as `max_input_length is deprecated for naming consistency.")
    return tokens if tokens is not None else length


def visible_devices(env: Mapping[str, str]) -> int | None:
    """TGI's device count: the entries of CUDA_VISIBLE_DEVICES, else
    NVIDIA_VISIBLE_DEVICES, else ZE_AFFINITY_MASK; None when none is set."""
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "ZE_AFFINITY_MASK"):
        if name in env:
            return len(env[name].split(","))
    return None


def _num_shard(sharded: bool | None, num_shard: int | None, env: Mapping[str, str]) -> int:
    """TGI's find_num_shards: --sharded true takes every visible device;
    neither flag takes every visible device too, or one shard without any."""
    if sharded and num_shard is None:
        found = visible_devices(env)
        if found is None:
            raise ConfigError("--num-shard and CUDA_VISIBLE_DEVICES/NVIDIA_VISIBLE_DEVICES/"
                              "ZE_AFFINITY_MASK are not set")
        if found <= 1:
            raise ConfigError(f"`sharded` is true but only found {found} CUDA devices")
        num_shard = found
    elif sharded and num_shard is not None and num_shard <= 1:
        raise ConfigError("`sharded` is true but `num_shard` <= 1")
    elif num_shard is None:
        num_shard = 1 if sharded is False else (visible_devices(env) or 1)
    if num_shard < 1:
        raise ConfigError("`num_shard` cannot be < 1")
    return num_shard


def _validate(c: RouterConfig) -> None:
    if c.quantize is not None and c.quantize not in QUANTIZE_SERVED:
        raise ConfigError(f"--quantize {c.quantize} is not supported (supported: {', '.join(QUANTIZE_SERVED)})")
    if c.waiting_served_ratio < 0:
        raise ConfigError(f"`waiting_served_ratio` must be >= 0. Given: {c.waiting_served_ratio}")
    if c.max_stall_ratio != 0 and c.max_stall_ratio <= 1:
        raise ConfigError(f"`max_stall_ratio` must be 0 (off) or > 1. Given: {c.max_stall_ratio}")
    if c.speculative_model and c.speculate == 0:
        raise ConfigError("`speculative_model` drafts nothing with `speculate` 0")
    if c.step_timeout < 0:
        raise ConfigError(f"`step_timeout` must be >= 0. Given: {c.step_timeout}")
    if c.request_read_timeout < 0:
        raise ConfigError(f"`request_read_timeout` must be >= 0. Given: {c.request_read_timeout}")
    if c.max_batch_size == 0:
        raise ConfigError("`max_batch_size` must be > 0")
    if not 0 < c.cuda_memory_fraction <= 1:
        raise ConfigError(f"`cuda_memory_fraction` must be in (0, 1]. Given: {c.cuda_memory_fraction}")
    if c.watermark_gamma is not None and not 0 < c.watermark_gamma < 1:
        raise ConfigError(f"`watermark_gamma` must be in (0, 1). Given: {c.watermark_gamma}")
    if c.rope_factor is not None and c.rope_factor <= 0:
        raise ConfigError(f"`rope_factor` must be > 0. Given: {c.rope_factor}")
    if None not in (c.max_input_tokens, c.max_total_tokens) and c.max_input_tokens >= c.max_total_tokens:
        raise ConfigError(f"`max_input_tokens`({c.max_input_tokens}) must be < "
                          f"`max_total_tokens`({c.max_total_tokens})")
    if c.max_batch_total_tokens is not None:
        if c.max_total_tokens is not None and c.max_total_tokens > c.max_batch_total_tokens:
            raise ConfigError(f"`max_total_tokens` must be <= `max_batch_total_tokens`. "
                              f"Given: {c.max_total_tokens} and {c.max_batch_total_tokens}")
        prefill = c.max_batch_prefill_tokens
        if prefill is not None and prefill > c.max_batch_total_tokens:
            raise ConfigError(f"`max_batch_prefill_tokens` must be <= `max_batch_total_tokens`. "
                              f"Given: {prefill} and {c.max_batch_total_tokens}")
