"""TGI 3's token limits, resolved once the shards have answered Info (the
model's max_position_embeddings) and Warmup (how many tokens the KV cache
holds): launcher/src/main.rs for the prefill default, backends/v3/src/lib.rs
`connect_backend` and backends/v3/src/main.rs for the rest and the checks."""

from __future__ import annotations

from dataclasses import dataclass

from tgi_router.launch.config import ConfigError, RouterConfig

DEFAULT_PREFILL_TOKENS = 4096        # TGI 3 without a GPU compute estimate
FALLBACK_BATCH_TOTAL_TOKENS = 16000  # TGI, when the shard cannot size its KV cache


@dataclass(frozen=True)
class Limits:
    """Token limits after TGI's derivation (see `resolve_limits`)."""
    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int


def prefill_tokens(config: RouterConfig, max_position_embeddings: int) -> int:
    """Tokens per step, needed before Warmup: the flag, else TGI 3's default
    min(4096, max_position_embeddings) (TGI's GPU compute estimate aside)."""
    if config.max_batch_prefill_tokens is not None:
        return config.max_batch_prefill_tokens
    if max_position_embeddings > 0:
        return min(DEFAULT_PREFILL_TOKENS, max_position_embeddings)
    return DEFAULT_PREFILL_TOKENS


def resolve_limits(config: RouterConfig, max_position_embeddings: int,
                   max_supported_total_tokens: int) -> Limits:
    """TGI 3's derivation from the model (Info) and the KV cache (Warmup):
    max_batch_total_tokens = what the cache holds (a smaller flag caps it; 0
      reported: the flag or max(16000, max_total_tokens, prefill) as TGI);
    max_total_tokens = min(max_batch_total_tokens, max_position_embeddings);
    max_input_tokens = max_total_tokens - 1;
    max_batch_prefill_tokens = `prefill_tokens`, a default clipped to the batch.
    Given flags are kept and checked with TGI's messages (ConfigError)."""
    c, supported = config, max_supported_total_tokens
    prefill = prefill_tokens(c, max_position_embeddings)
    if supported > 0:
        batch_total = min(supported, c.max_batch_total_tokens or supported)
    else:
        batch_total = c.max_batch_total_tokens or max(
            FALLBACK_BATCH_TOTAL_TOKENS, c.max_total_tokens or 0, prefill)
    total = c.max_total_tokens
    if total is None:
        total = min(batch_total, max_position_embeddings) if max_position_embeddings > 0 else batch_total
    max_input = c.max_input_tokens if c.max_input_tokens is not None else total - 1
    if c.max_batch_prefill_tokens is None:
        prefill = min(prefill, batch_total)
    if supported > 0 and total > supported:
        raise ConfigError(f"Not enough memory to handle `max_total_tokens={total}`")
    if total > batch_total:
        raise ConfigError(f"`max_total_tokens` must be <= `max_batch_total_tokens`. "
                          f"Given: {total} and {batch_total}")
    if max_input >= total:
        raise ConfigError(f"`max_input_tokens`({max_input}) must be < `max_total_tokens`({total})")
    if prefill > batch_total:
        raise ConfigError(f"`max_batch_prefill_tokens` must be <= `max_batch_total_tokens`. "
                          f"Given: {prefill} and {batch_total}")
    return Limits(max_input, total, prefill, batch_total)
