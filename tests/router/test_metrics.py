"""The /metrics exposition: TGI's names, types, labels and buckets (no model)."""

import re
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tgi_router.telemetry.metrics import Metrics, duration_buckets

TGI_TYPES = {
    "tgi_request_count": "counter",
    "tgi_request_success": "counter",
    "tgi_request_failure": "counter",
    "tgi_request_duration": "histogram",
    "tgi_request_validation_duration": "histogram",
    "tgi_request_queue_duration": "histogram",
    "tgi_request_inference_duration": "histogram",
    "tgi_request_mean_time_per_token_duration": "histogram",
    "tgi_request_input_length": "histogram",
    "tgi_request_generated_tokens": "histogram",
    "tgi_request_max_new_tokens": "histogram",
    "tgi_queue_size": "gauge",
    "tgi_batch_current_size": "gauge",
    "tgi_batch_current_max_tokens": "gauge",
    "tgi_batch_max_total_tokens": "gauge",
    "tgi_batch_next_size": "histogram",
    "tgi_batch_inference_count": "counter",
    "tgi_batch_inference_success": "counter",
    "tgi_batch_inference_failure": "counter",
    "tgi_batch_forward_duration": "histogram",
    "tgi_batch_decode_duration": "histogram",
    "tgi_batch_filter_duration": "histogram",
    "tgi_batch_inference_duration": "histogram",
    "tgi_batch_concat": "counter",
    "tgi_request_skipped_tokens": "histogram",
}
EXTRA_TYPES = {
    "tgi_request_duration_seconds": "histogram",
    "tgi_request_mean_time_seconds": "histogram",
    "tgi_request_time_to_first_token_duration": "histogram",
    "tgi_request_inter_token_latency_duration": "histogram",
    "tgi_kv_cache_blocks_capacity": "gauge",
    "tgi_kv_cache_blocks_used": "gauge",
    "tgi_kv_cache_blocks_free": "gauge",
    "tgi_kv_cache_blocks_cached": "gauge",
    "tgi_prefix_cache_queried_tokens": "counter",
    "tgi_prefix_cache_hit_tokens": "counter",
    "tgi_request_prefill_chunks": "histogram",
    "tgi_lora_requests": "counter",
    "tgi_otlp_spans_exported": "counter",
    "tgi_otlp_spans_dropped": "counter",
    "tgi_speculative_draft_tokens": "counter",
    "tgi_speculative_accepted_tokens": "counter",
    "tgi_speculative_acceptance_rate": "gauge",
}


def scrape(m: Metrics) -> str:
    return m.render().decode("utf-8")


def types(text: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def samples(text: str, name: str) -> list[str]:
    """Sample lines of family `name` (its buckets, sums and counts included)."""
    return [line for line in text.splitlines()
            if re.match(rf"{name}(_bucket|_sum|_count)?[{{ ]", line)]


def value(text: str, series: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(series + " ")]
    return float(line.rsplit(" ", 1)[1])


def les(text: str, name: str) -> list[str]:
    return re.findall(rf'^{name}_bucket\{{(?:[^}}]*,)?le="([^"]+)"\}}', text, re.M)


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(max_input_tokens=1000, max_total_tokens=2000)


def step(m: Metrics, method: str = "decode", size: int = 3, max_tokens: int = 120) -> None:
    m.batch_step(method, forward_s=0.02, decode_s=0.001, filter_s=0.002, inference_s=0.025,
                 size=size, max_tokens=max_tokens)


def test_every_tgi_name_has_its_type_line(metrics):
    assert types(scrape(metrics)) == TGI_TYPES | EXTRA_TYPES


def test_skipped_tokens_use_tgis_buckets_and_speculation_counts():
    m = Metrics(max_input_tokens=1000, max_total_tokens=2000, speculate=3)
    m.speculated([0, 3, 1], drafted=7, accepted=4, rate=4 / 7)
    m.speculated([2], drafted=3, accepted=2, rate=6 / 10)
    text = scrape(m)
    assert les(text, "tgi_request_skipped_tokens") == ["0.0", "1.0", "2.0", "3.0", "+Inf"]  # 0..speculate
    assert value(text, "tgi_request_skipped_tokens_count") == 4
    assert value(text, "tgi_request_skipped_tokens_sum") == 6
    assert value(text, 'tgi_request_skipped_tokens_bucket{le="1.0"}') == 2
    assert value(text, "tgi_speculative_draft_tokens") == 10
    assert value(text, "tgi_speculative_accepted_tokens") == 6
    assert value(text, "tgi_speculative_acceptance_rate") == pytest.approx(0.6)


def test_exposition_parses_as_prometheus_text(metrics):
    step(metrics)
    names = {f.name for f in text_string_to_metric_families(scrape(metrics))}
    assert set(TGI_TYPES) | set(EXTRA_TYPES) <= names
    assert metrics.content_type == "text/plain; version=0.0.4; charset=utf-8"


def test_counters_have_no_total_suffix_and_no_created_series(metrics):
    metrics.request_received()
    metrics.request_received()
    text = scrape(metrics)
    assert "# TYPE tgi_request_count counter\ntgi_request_count 2.0\n" in text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
             if not line.startswith("#")}
    assert not [n for n in names if n.endswith(("_total", "_created"))]


def test_request_failure_is_labelled_by_err(metrics):
    metrics.request_failed("overloaded")
    text = scrape(metrics)
    assert value(text, 'tgi_request_failure{err="overloaded"}') == 1
    for err in ("validation", "template", "incomplete", "dropped", "generation"):
        assert value(text, f'tgi_request_failure{{err="{err}"}}') == 0


def test_batch_metrics_are_labelled_by_method(metrics):
    step(metrics, "prefill")
    step(metrics, "decode")
    step(metrics, "decode")
    metrics.batch_failed("decode")
    text = scrape(metrics)
    assert value(text, 'tgi_batch_inference_count{method="prefill"}') == 1
    assert value(text, 'tgi_batch_inference_count{method="decode"}') == 3
    assert value(text, 'tgi_batch_inference_success{method="decode"}') == 2
    assert value(text, 'tgi_batch_inference_failure{method="decode"}') == 1
    for name in ("forward", "decode", "filter", "inference"):
        assert value(text, f'tgi_batch_{name}_duration_count{{method="decode"}}') == 2
    assert value(text, 'tgi_batch_inference_duration_sum{method="prefill"}') == 0.025


def test_batch_concat_is_labelled_by_reason(metrics):
    metrics.batch_concat("backpressure")
    metrics.batch_concat("wait_exceeded")
    metrics.batch_concat("wait_exceeded")
    text = scrape(metrics)
    assert value(text, 'tgi_batch_concat{reason="backpressure"}') == 1
    assert value(text, 'tgi_batch_concat{reason="wait_exceeded"}') == 2


@pytest.mark.parametrize("call", [
    lambda m: m.request_failed("timeout"),
    lambda m: m.batch_concat("other"),
    lambda m: m.batch_failed("prefil"),
    lambda m: step(m, "chunked"),
])
def test_label_values_outside_tgis_sets_are_refused(metrics, call):
    with pytest.raises(ValueError):
        call(metrics)


def test_duration_histograms_use_tgis_35_geometric_buckets(metrics):
    text = scrape(metrics)
    expected = duration_buckets()
    assert len(expected) == 35
    assert expected[0] == pytest.approx(0.00015)
    assert expected[-1] == pytest.approx(0.0001 * 1.5 ** 35)
    for name in TGI_TYPES | EXTRA_TYPES:
        if name.endswith("_duration"):
            bounds = les(text, name)
            assert bounds[-1] == "+Inf", name
            assert [float(b) for b in bounds[:35]] == expected, name


def test_token_histograms_scale_with_the_token_limits(metrics):
    text = scrape(metrics)
    assert [float(b) for b in les(text, "tgi_request_input_length")[:-1]] == \
        [10.0 * (x + 1) for x in range(100)]
    for name in ("tgi_request_generated_tokens", "tgi_request_max_new_tokens"):
        assert [float(b) for b in les(text, name)[:-1]] == [20.0 * (x + 1) for x in range(100)]
    assert [float(b) for b in les(text, "tgi_batch_next_size")[:-1]] == \
        [float(x) for x in range(1, 1025)]


def test_request_finished_records_tgis_request_timings(metrics):
    metrics.request_received()
    metrics.request_validated(input_length=35, max_new_tokens=64)
    metrics.request_finished(total_s=2.0, validation_s=0.01, queue_s=0.19, inference_s=1.8,
                             generated_tokens=9)
    text = scrape(metrics)
    assert value(text, "tgi_request_success") == 1
    assert value(text, "tgi_request_duration_sum") == 2.0
    assert value(text, "tgi_request_validation_duration_sum") == 0.01
    assert value(text, "tgi_request_queue_duration_sum") == 0.19
    assert value(text, "tgi_request_inference_duration_sum") == 1.8
    assert value(text, "tgi_request_mean_time_per_token_duration_sum") == pytest.approx(0.2)
    assert value(text, "tgi_request_generated_tokens_sum") == 9
    assert value(text, "tgi_request_input_length_sum") == 35
    assert value(text, 'tgi_request_input_length_bucket{le="30.0"}') == 0
    assert value(text, 'tgi_request_input_length_bucket{le="40.0"}') == 1
    assert value(text, "tgi_request_max_new_tokens_sum") == 64


@pytest.mark.parametrize("name,alias", [
    ("tgi_request_duration", "tgi_request_duration_seconds"),
    ("tgi_request_mean_time_per_token_duration", "tgi_request_mean_time_seconds"),
])
def test_seconds_aliases_carry_the_same_observations(metrics, name, alias):
    for total in (0.05, 0.4, 3.0):
        metrics.request_finished(total_s=total, validation_s=0.001, queue_s=0.01,
                                 inference_s=total / 2, generated_tokens=4)
    text = scrape(metrics)
    original = samples(text, name)
    assert len(original) == 35 + 3
    assert samples(text, alias) == [line.replace(name, alias, 1) for line in original]


def test_first_token_and_inter_token_latency_histograms(metrics):
    metrics.first_token(0.3)
    for gap in (0.02, 0.03, 0.05):
        metrics.inter_token(gap)
    text = scrape(metrics)
    assert value(text, "tgi_request_time_to_first_token_duration_count") == 1
    assert value(text, "tgi_request_time_to_first_token_duration_sum") == 0.3
    assert value(text, "tgi_request_inter_token_latency_duration_count") == 3
    assert value(text, "tgi_request_inter_token_latency_duration_sum") == pytest.approx(0.1)


def test_gauges_hold_the_latest_value(metrics):
    metrics.queue_size(7)
    metrics.queue_size(4)
    metrics.max_total_tokens(16384)
    step(metrics, size=5, max_tokens=900)
    metrics.kv_blocks(total=512, used=100, free=412)
    metrics.next_batch(5)
    text = scrape(metrics)
    assert value(text, "tgi_queue_size") == 4
    assert value(text, "tgi_batch_max_total_tokens") == 16384
    assert value(text, "tgi_batch_current_size") == 5
    assert value(text, "tgi_batch_current_max_tokens") == 900
    assert value(text, "tgi_kv_cache_blocks_capacity") == 512
    assert value(text, "tgi_kv_cache_blocks_used") == 100
    assert value(text, "tgi_kv_cache_blocks_free") == 412
    assert value(text, 'tgi_batch_next_size_bucket{le="5.0"}') == 1
    metrics.batch_idle()
    text = scrape(metrics)
    assert value(text, "tgi_batch_current_size") == 0
    assert value(text, "tgi_batch_current_max_tokens") == 0


def test_prefix_cache_and_prefill_chunk_metrics(metrics):
    metrics.prefix_cache(queried_tokens=100, hit_tokens=64)
    metrics.prefix_cache(queried_tokens=20, hit_tokens=0)
    for chunks in (1, 1, 5):
        metrics.prefill_chunks(chunks)
    metrics.kv_blocks(total=512, used=100, free=412, cached=40)
    text = scrape(metrics)
    assert value(text, "tgi_prefix_cache_queried_tokens") == 120
    assert value(text, "tgi_prefix_cache_hit_tokens") == 64
    assert value(text, "tgi_request_prefill_chunks_count") == 3
    assert value(text, 'tgi_request_prefill_chunks_bucket{le="1.0"}') == 2
    assert value(text, 'tgi_request_prefill_chunks_bucket{le="6.0"}') == 3
    assert value(text, "tgi_kv_cache_blocks_cached") == 40


def test_two_instances_are_independent():
    a, b = Metrics(100, 200), Metrics(100, 200)
    a.request_received()
    a.queue_size(3)
    assert value(scrape(a), "tgi_request_count") == 1
    assert value(scrape(b), "tgi_request_count") == 0
    assert value(scrape(b), "tgi_queue_size") == 0


def test_importing_the_metrics_module_does_not_import_torch():
    code = "import sys, tgi_router.telemetry.metrics; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
