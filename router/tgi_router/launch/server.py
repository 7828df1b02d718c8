"""Runs the router: connects to the shards, warms them up, derives the
limits, and serves HTTP until shutdown, draining in-flight requests."""

import asyncio
import contextlib
import functools
import json
import logging
import time
from importlib.metadata import PackageNotFoundError, version

import uvicorn

from tgi_router.app import create_app
from tgi_router.launch.config import RouterConfig
from tgi_router.launch.limits import prefill_tokens, resolve_limits
from tgi_router.request import protocol as p
from tgi_router.request.validation import ValidationLimits
from tgi_router.scheduling.block_manager import BlockManager
from tgi_router.scheduling.client import ShardClient, ShardError
from tgi_router.scheduling.engine import Engine
from tgi_router.scheduling.scheduler import Scheduler
from tgi_router.scheduling.speculation import SpeculationPolicy
from tgi_router.scheduling.step_pacer import StepPacer
from tgi_router.telemetry.metrics import Metrics
from tgi_router.text.input_bound import max_chars_per_token
from tgi_router.text.reasoning import ReasoningParser
from tgi_router.text.tokenizer import RouterTokenizer
from tgi_router.web.admission import ApiSettings, ServerState
from tgi_router.web.read_deadline import ReadDeadlineProtocol

log = logging.getLogger("tgi_router")
SHARD_FAILURE_GRACE = 10.0  # seconds /health answers 503 after a shard died, before exiting


async def serve_router(config: RouterConfig, shard_failed: asyncio.Event, shutdown: asyncio.Event) -> int:
    """Serves until `shutdown` (exit 0 once drained) or a shard failure
    (in-flight requests fail, /health turns 503, exit 1)."""
    client = ShardClient.for_shards(config.shard_uds_path, config.num_shard,
                                    step_timeout=config.step_timeout or None)
    try:
        engine, app, state = await _build(config, client)
    except ShardError as err:
        log.error("shards failed during warmup: %s", err)
        await client.close()
        return 1
    http = (functools.partial(ReadDeadlineProtocol, read_timeout=config.request_read_timeout)
            if config.request_read_timeout > 0 else "h11")
    server = _Server(uvicorn.Config(app, host=config.hostname, port=config.port, log_level="warning",
                                    log_config=None, lifespan="off", timeout_graceful_shutdown=1, http=http))
    serving = asyncio.ensure_future(server.serve())
    stepping = asyncio.ensure_future(engine.run_forever())
    log.info("router listening on http://%s:%d", config.hostname, config.port)
    stops = {asyncio.ensure_future(shutdown.wait()), asyncio.ensure_future(shard_failed.wait())}
    await asyncio.wait(stops | {serving, stepping}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if shard_failed.is_set() or stepping.done() or not engine.healthy:
        code = 1
        engine.healthy = False
        engine.fail_all("Request failed during generation: Server error: a shard stopped")
        log.error("a shard failed: in-flight requests failed, /health answers 503")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(shutdown.wait(), SHARD_FAILURE_GRACE)
    else:
        await _drain(state, config.graceful_termination_timeout)
    server.should_exit = True
    for task in (*stops, stepping):
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await serving
    await client.close()
    if (tracing := getattr(app.state, "tracing", None)) is not None:
        await asyncio.to_thread(tracing.shutdown)  # the last requests' spans go out before the exit
    return code


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # The launcher owns SIGTERM/SIGINT and drains before stopping uvicorn;
        # uvicorn's own capture would re-raise them when it exits.
        yield


async def _drain(state: ServerState, grace: float) -> None:
    """Refuses new requests and waits for the ones in flight, up to `grace`."""
    state.draining = True
    deadline = time.monotonic() + grace
    while state.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    log.info("drained (%d requests still in flight)", state.in_flight)


async def _build(config: RouterConfig, client: ShardClient):
    await client.wait_ready(60)
    info = await client.info()
    tokenizer = RouterTokenizer(info.tokenizer_json, _tokenizer_config(info, config))
    warm = await client.warmup(prefill_tokens(config, info.max_position_embeddings),
                               config.max_batch_size or 0, config.kv_cache_bytes)
    limits = resolve_limits(config, info.max_position_embeddings, warm.max_supported_total_tokens)
    if info.adapter_ids:
        log.info("LoRA adapters: %s", ", ".join(info.adapter_ids))
    log.info("warmed up: %d KV blocks of %d tokens; max_input_tokens=%d max_total_tokens=%d "
             "max_batch_prefill_tokens=%d max_batch_total_tokens=%d", warm.num_blocks, warm.block_size,
             limits.max_input_tokens, limits.max_total_tokens, limits.max_batch_prefill_tokens,
             limits.max_batch_total_tokens)
    # TGI's default: a model with Medusa heads drafts as many tokens as it has heads.
    speculate = config.speculate if config.speculate is not None else info.medusa_heads
    if speculate:
        log.info("speculative decoding: up to %d drafts per sequence and step, from %s", speculate,
                 "the Medusa heads" if info.medusa_heads else
                 "the speculative model" if config.speculative_model else "n-gram lookup")
    metrics = Metrics(limits.max_input_tokens, limits.max_total_tokens, tuple(info.adapter_ids), speculate)
    metrics.max_total_tokens(limits.max_batch_total_tokens)
    metrics.kv_blocks(warm.num_blocks, 0, warm.num_blocks)
    blocks = BlockManager(warm.num_blocks, warm.block_size, config.prefix_caching)
    scheduler = Scheduler(blocks, limits.max_batch_prefill_tokens, config.max_batch_size or 0,
                          config.waiting_served_ratio, config.max_waiting_tokens,
                          StepPacer(warm.block_size, config.max_stall_ratio) if config.max_stall_ratio else None,
                          SpeculationPolicy(speculate) if speculate else None)
    engine = Engine(client, scheduler, tokenizer, tuple(info.eos_token_ids), metrics)
    settings = ApiSettings(
        info=p.Info(model_id=info.model_id, max_concurrent_requests=config.max_concurrent_requests,
                    max_best_of=config.max_best_of, max_stop_sequences=config.max_stop_sequences,
                    max_input_tokens=limits.max_input_tokens, max_total_tokens=limits.max_total_tokens,
                    validation_workers=1, max_client_batch_size=config.max_client_batch_size,
                    version=_version()),
        limits=ValidationLimits(max_input_tokens=limits.max_input_tokens, max_total_tokens=limits.max_total_tokens,
                                max_best_of=config.max_best_of, max_stop_sequences=config.max_stop_sequences,
                                max_top_n_tokens=config.max_top_n_tokens,
                                disable_grammar_support=config.disable_grammar_support,
                                max_input_chars=_max_input_chars(info.tokenizer_json, limits.max_input_tokens),
                                adapters=tuple(info.adapter_ids), model_id=info.model_id),
        max_concurrent_requests=config.max_concurrent_requests, api_key=config.api_key,
        cors_allow_origin=tuple(config.cors_allow_origin), payload_limit=config.payload_limit,
        compute_type="gpu+optimized" if info.device.startswith("cuda") else "cpu",
        protect_metrics=config.protect_metrics, playground=not config.disable_playground,
        reasoning=ReasoningParser(config.reasoning_parser) if config.reasoning_parser else None)
    state = ServerState()
    app = create_app(engine, settings, metrics, state)
    if config.otlp_endpoint:
        from tgi_router.telemetry.tracing import Tracing, TracingMiddleware

        engine.tracing = True
        app.state.tracing = Tracing(config.otlp_endpoint, config.otlp_service_name, metrics)
        app.add_middleware(TracingMiddleware, tracing=app.state.tracing)
        log.info("exporting traces to %s as %s", config.otlp_endpoint, config.otlp_service_name)
    return engine, app, state


def _max_input_chars(tokenizer_json: str, max_input_tokens: int) -> int | None:
    """The longest input that may still fit max_input_tokens (None: the
    tokenizer gives no bound); longer ones are refused before tokenizing."""
    per_token = max_chars_per_token(tokenizer_json)
    return None if per_token is None else max_input_tokens * per_token


def _tokenizer_config(info, config: RouterConfig) -> str:
    """The shard's tokenizer config, with --tokenizer-config-path's chat
    template (and special tokens) taking precedence."""
    if not config.tokenizer_config_path:
        return info.tokenizer_config_json
    merged = json.loads(info.tokenizer_config_json or "{}")
    with open(config.tokenizer_config_path) as f:
        override = json.load(f)
    merged.update({k: override[k] for k in ("chat_template", "bos_token", "eos_token") if k in override})
    return json.dumps(merged)


def _version() -> str:
    try:
        return version("tgi-py")
    except PackageNotFoundError:
        return "0.0.0"
