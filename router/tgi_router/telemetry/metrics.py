"""Prometheus metrics under TGI's exact names, types, labels and buckets.

TGI's router records its metrics with the Rust `metrics` crate and serves them
with `metrics-exporter-prometheus`; dashboards written for TGI query those
names, so this module reproduces them exactly (and `metrics_exposition`
writes them as TGI's exporter does, counters without `_total`):

* histograms use TGI's buckets: every `*_duration` metric 35 geometric buckets
  0.0001 * 1.5**k for k = 1..35 (0.00015 s to about 146 s); input length one
  hundredth of `max_input_tokens` steps, generated and max-new tokens one
  hundredth of `max_total_tokens` steps, next batch size 1..1024
  (router/src/server.rs, `PrometheusBuilder::set_buckets_for_metric`).

Beyond TGI:

* `tgi_request_duration_seconds` and `tgi_request_mean_time_seconds` repeat
  the series of `tgi_request_duration` and
  `tgi_request_mean_time_per_token_duration` for dashboards built on
  third-party guides' names (TGI itself never exposed either);
* `tgi_request_time_to_first_token_duration`: seconds from a request's arrival
  to its first generated token, one observation per request;
* `tgi_request_inter_token_latency_duration`: seconds between two consecutive
  generated tokens of one request, one observation per gap (TGI only has the
  per-request mean, `tgi_request_mean_time_per_token_duration`);
* `tgi_kv_cache_blocks_{capacity,used,free,cached}` gauges (capacity, not
  `_total`: a `_total` suffix marks counters in Prometheus' naming rules);
  used + free == capacity, and cached counts the free blocks that still hold
  a reusable prefix;
* `tgi_prefix_cache_{queried,hit}_tokens` counters: prompt tokens looked up in
  the prefix cache at admission, and those found there (not computed);
* `tgi_request_prefill_chunks`: steps each prefill took (1 when unchunked);
* `tgi_lora_requests{adapter}`: requests per LoRA adapter (--lora-adapters;
  the base model's requests are not counted here);
* `tgi_otlp_spans_{exported,dropped}` counters: trace spans the OTLP
  exporter sent, and those it dropped (--otlp-endpoint; 0 without);
* `tgi_speculative_{draft,accepted}_tokens` counters and the
  `tgi_speculative_acceptance_rate` gauge (accepted / drafted since start):
  speculative decoding (--speculate). TGI's own `tgi_request_skipped_tokens`
  histogram (buckets 0..speculate) takes, per sequence and step, the tokens
  past the first that the step gave it.

Label sets that TGI closes (`method`, `err`, `reason`) are checked and their
series created at zero up front, so `increase()` sees the first event.
"""

from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tgi_router.telemetry.metrics_exposition import CONTENT_TYPE, exposition

Method = Literal["prefill", "decode"]
METHODS: tuple[Method, ...] = ("prefill", "decode")
# Every `err` TGI's router and v3 backend use for tgi_request_failure.
FAILURE_REASONS = ("validation", "overloaded", "template", "incomplete", "dropped", "generation")
# backpressure: new requests joined a running batch while it was still young
# (TGI's min_size branch); wait_exceeded: after max_waiting_tokens steps.
CONCAT_REASONS = ("backpressure", "wait_exceeded")
ALIASES = {
    "tgi_request_duration": "tgi_request_duration_seconds",
    "tgi_request_mean_time_per_token_duration": "tgi_request_mean_time_seconds",
}
PREFILL_CHUNK_BUCKETS = [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 128.0, 256.0]


def duration_buckets() -> list[float]:
    """TGI's `Matcher::Suffix("duration")` buckets, bit for bit (same float ops)."""
    value, buckets = 0.0001, []
    for _ in range(35):
        value *= 1.5
        buckets.append(value)
    return buckets


def linear_buckets(limit: int, n: int = 100) -> list[float]:
    """TGI's `(limit / 100) * (x + 1)` for x in 0..100."""
    return [(limit / float(n)) * (x + 1) for x in range(n)]


def _check(value: str, allowed: tuple[str, ...], label: str) -> str:
    if value not in allowed:
        raise ValueError(f"{label}={value!r} is not one of TGI's {allowed}")
    return value


class Metrics:
    """The router's metrics, in a registry of their own.

    One instance per server; the router calls the methods below at the
    moments TGI records the same metric, and serves `render()` with
    `content_type` on GET /metrics. All durations are seconds.

    `max_input_tokens` and `max_total_tokens` size the token-count buckets as
    TGI does; both must be positive.
    """

    def __init__(self, max_input_tokens: int, max_total_tokens: int, adapters: tuple[str, ...] = (),
                 speculate: int = 0):
        if max_input_tokens < 1 or max_total_tokens < 1:
            raise ValueError("max_input_tokens and max_total_tokens must be positive")
        self.registry = CollectorRegistry(auto_describe=True)
        self.content_type = CONTENT_TYPE
        self._build_request_metrics(max_input_tokens, max_total_tokens)
        self._build_batch_metrics()
        self._skipped_tokens = self._histogram(
            "tgi_request_skipped_tokens", "Speculated tokens per request", [float(x) for x in range(speculate + 1)])
        self._draft_tokens = self._counter("tgi_speculative_draft_tokens", "Draft tokens the shards checked")
        self._accepted_tokens = self._counter(
            "tgi_speculative_accepted_tokens", "Draft tokens accepted (equal to the token decoding would give)")
        self._acceptance_rate = self._gauge(
            "tgi_speculative_acceptance_rate", "Accepted draft tokens per draft token checked, since start")
        self._lora_requests = self._counter("tgi_lora_requests", "Requests per LoRA adapter", ("adapter",))
        for adapter in adapters:
            self._lora_requests.labels(adapter)

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: list[float],
                   labels: tuple[str, ...] = ()) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

    def _build_request_metrics(self, max_input_tokens: int, max_total_tokens: int) -> None:
        d = duration_buckets()
        self._request_count = self._counter("tgi_request_count", "Total number of requests")
        self._request_success = self._counter("tgi_request_success", "Number of successful requests")
        self._request_failure = self._counter(
            "tgi_request_failure", "Number of failed requests per error kind", ("err",))
        for err in FAILURE_REASONS:
            self._request_failure.labels(err)
        self._request_duration = self._histogram(
            "tgi_request_duration", "Total time spent processing the request (e2e latency)", d)
        self._validation_duration = self._histogram(
            "tgi_request_validation_duration", "Time spent validating the request", d)
        self._queue_duration = self._histogram(
            "tgi_request_queue_duration", "Time spent in the queue per request", d)
        self._inference_duration = self._histogram(
            "tgi_request_inference_duration", "Request inference duration", d)
        self._mean_time_per_token = self._histogram(
            "tgi_request_mean_time_per_token_duration",
            "Mean time per token per request (inter-token latency)", d)
        self._time_to_first_token = self._histogram(
            "tgi_request_time_to_first_token_duration",
            "Time from request arrival to its first generated token", d)
        self._inter_token_latency = self._histogram(
            "tgi_request_inter_token_latency_duration",
            "Time between two consecutive generated tokens of a request", d)
        self._input_length = self._histogram(
            "tgi_request_input_length", "Input token length per request",
            linear_buckets(max_input_tokens))
        self._generated_tokens = self._histogram(
            "tgi_request_generated_tokens", "Generated tokens per request",
            linear_buckets(max_total_tokens))
        self._max_new_tokens = self._histogram(
            "tgi_request_max_new_tokens", "Maximum new tokens per request",
            linear_buckets(max_total_tokens))
        self._queue_size = self._gauge("tgi_queue_size", "Current queue size")

    def _build_batch_metrics(self) -> None:
        d = duration_buckets()
        m = ("method",)
        self._batch_current_size = self._gauge("tgi_batch_current_size", "Current batch size")
        self._batch_current_max_tokens = self._gauge(
            "tgi_batch_current_max_tokens", "Maximum tokens for the current batch")
        self._batch_max_total_tokens = self._gauge(
            "tgi_batch_max_total_tokens", "Maximum amount of tokens in total")
        self._batch_next_size = self._histogram(
            "tgi_batch_next_size", "Batch size of the next batch",
            [float(x + 1) for x in range(1024)])
        self._inference_count = self._counter(
            "tgi_batch_inference_count", "Inference calls per method (prefill or decode)", m)
        self._inference_success = self._counter(
            "tgi_batch_inference_success",
            "Number of successful inference calls per method (prefill or decode)", m)
        self._inference_failure = self._counter(
            "tgi_batch_inference_failure",
            "Number of failed inference calls per method (prefill or decode)", m)
        self._forward_duration = self._histogram(
            "tgi_batch_forward_duration",
            "Batch forward duration per method (prefill or decode)", d, m)
        self._decode_duration = self._histogram(
            "tgi_batch_decode_duration",
            "Time spent decoding a batch per method (prefill or decode)", d, m)
        self._filter_duration = self._histogram(
            "tgi_batch_filter_duration",
            "Time spent filtering batches and sending generated tokens per method "
            "(prefill or decode)", d, m)
        self._batch_inference_duration = self._histogram(
            "tgi_batch_inference_duration", "Batch inference duration", d, m)
        for metric in (self._inference_count, self._inference_success, self._inference_failure,
                       self._forward_duration, self._decode_duration, self._filter_duration,
                       self._batch_inference_duration):
            for method in METHODS:
                metric.labels(method)
        self._batch_concat = self._counter(
            "tgi_batch_concat", "Number of times new requests joined a running batch", ("reason",))
        for reason in CONCAT_REASONS:
            self._batch_concat.labels(reason)
        self._kv_capacity = self._gauge("tgi_kv_cache_blocks_capacity", "KV cache blocks in all")
        self._kv_used = self._gauge("tgi_kv_cache_blocks_used", "KV cache blocks held by sequences")
        self._kv_free = self._gauge("tgi_kv_cache_blocks_free", "KV cache blocks free to allocate")
        self._kv_cached = self._gauge(
            "tgi_kv_cache_blocks_cached", "Free KV cache blocks holding a reusable prefix")
        self._prefix_queried = self._counter(
            "tgi_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache")
        self._prefix_hit = self._counter(
            "tgi_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache")
        self._prefill_chunks = self._histogram(
            "tgi_request_prefill_chunks", "Steps (chunks) each prefill took", PREFILL_CHUNK_BUCKETS)
        self._otlp_exported = self._counter("tgi_otlp_spans_exported", "Trace spans sent to the OTLP collector")
        self._otlp_dropped = self._counter(
            "tgi_otlp_spans_dropped", "Trace spans dropped: export queue full or the collector unreachable")

    # Requests: TGI's router/src/server.rs, infer/mod.rs and validation.rs.

    def request_received(self) -> None:
        """A generate, stream, completions or chat request arrived."""
        self._request_count.inc()

    def request_validated(self, input_length: int, max_new_tokens: int) -> None:
        """Validation accepted a request with these token counts."""
        self._input_length.observe(input_length)
        self._max_new_tokens.observe(max_new_tokens)

    def request_failed(self, err: str) -> None:
        """A request failed; `err` is one of FAILURE_REASONS."""
        self._request_failure.labels(_check(err, FAILURE_REASONS, "err")).inc()

    def request_finished(self, *, total_s: float, validation_s: float, queue_s: float,
                         inference_s: float, generated_tokens: int) -> None:
        """A request ended successfully.

        total: arrival to end; validation: arrival to queued; queue: queued to
        first scheduled; inference: first scheduled to end. The mean time per
        token is inference / generated tokens, as TGI computes it.
        """
        self._request_success.inc()
        self._request_duration.observe(total_s)
        self._validation_duration.observe(validation_s)
        self._queue_duration.observe(queue_s)
        self._inference_duration.observe(inference_s)
        self._mean_time_per_token.observe(inference_s / max(generated_tokens, 1))
        self._generated_tokens.observe(generated_tokens)

    def first_token(self, seconds: float) -> None:
        """Arrival to the first generated token of one request."""
        self._time_to_first_token.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        """Gap between two consecutive generated tokens of one request."""
        self._inter_token_latency.observe(seconds)

    def queue_size(self, n: int) -> None:
        self._queue_size.set(n)

    # Batches: TGI's backends/v3/src/{backend,queue,lib}.rs.

    def max_total_tokens(self, n: int) -> None:
        """The token budget of all running sequences, set once after warmup."""
        self._batch_max_total_tokens.set(n)

    def next_batch(self, size: int) -> None:
        """`size` requests left the queue together into a new batch."""
        self._batch_next_size.observe(size)

    def batch_concat(self, reason: str) -> None:
        """New requests joined a running batch; `reason` is one of CONCAT_REASONS."""
        self._batch_concat.labels(_check(reason, CONCAT_REASONS, "reason")).inc()

    def batch_step(self, method: Method, *, forward_s: float, decode_s: float, filter_s: float,
                   inference_s: float, size: int, max_tokens: int) -> None:
        """One successful forward of `size` sequences.

        forward and decode: the shard's timings; filter: applying the answer
        to the batch (tokens appended, finished sequences dropped); inference:
        from sending the step (or the previous answer, if later) to its answer
        applied. max_tokens: the tokens the batch may reach (prompts + max new
        tokens).
        """
        _check(method, METHODS, "method")
        self._inference_count.labels(method).inc()
        self._inference_success.labels(method).inc()
        self._forward_duration.labels(method).observe(forward_s)
        self._decode_duration.labels(method).observe(decode_s)
        self._filter_duration.labels(method).observe(filter_s)
        self._batch_inference_duration.labels(method).observe(inference_s)
        self._batch_current_size.set(size)
        self._batch_current_max_tokens.set(max_tokens)

    def batch_failed(self, method: Method) -> None:
        """A forward failed; its requests fail with err="generation"."""
        _check(method, METHODS, "method")
        self._inference_count.labels(method).inc()
        self._inference_failure.labels(method).inc()

    def batch_idle(self) -> None:
        """No batch is running: TGI zeroes the current-batch gauges."""
        self._batch_current_size.set(0)
        self._batch_current_max_tokens.set(0)

    def kv_blocks(self, total: int, used: int, free: int, cached: int = 0) -> None:
        """used: referenced by sequences; free: allocatable, of which
        `cached` still hold a reusable prefix (evicted when needed)."""
        self._kv_capacity.set(total)
        self._kv_used.set(used)
        self._kv_free.set(free)
        self._kv_cached.set(cached)

    def prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None:
        """Admitted prompts' tokens looked up in the prefix cache, and found."""
        self._prefix_queried.inc(queried_tokens)
        self._prefix_hit.inc(hit_tokens)

    def prefill_chunks(self, chunks: int) -> None:
        """A prefill completed after `chunks` steps."""
        self._prefill_chunks.observe(chunks)

    def speculated(self, skipped: list[int], drafted: int, accepted: int, rate: float) -> None:
        """One step's speculation: per sequence that sampled, the tokens it got
        past the first; drafts checked and accepted in all; the rate since start."""
        for n in skipped:
            self._skipped_tokens.observe(n)
        self._draft_tokens.inc(drafted)
        self._accepted_tokens.inc(accepted)
        self._acceptance_rate.set(rate)

    def lora_request(self, adapter: str) -> None:
        """A validated request runs LoRA adapter `adapter` (one of those loaded)."""
        self._lora_requests.labels(adapter).inc()

    def otlp_spans(self, exported: int = 0, dropped: int = 0) -> None:
        """Spans the OTLP exporter sent or dropped (called from its thread)."""
        self._otlp_exported.inc(exported)
        self._otlp_dropped.inc(dropped)

    def render(self) -> bytes:
        """The Prometheus text exposition (format 0.0.4), with TGI's names."""
        return exposition(self.registry, ALIASES)
