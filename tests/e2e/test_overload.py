"""Overload on loopback against the real launcher: more clients than
--max-concurrent-requests. The excess hears 429 without waiting for
service, every admitted request finishes, the queue metrics add up, the KV
cache and the router's memory return to where they were."""

import asyncio
import signal

import pytest

from benchmarks.overload import BODY, metric, overload, rss_bytes

from ..shard_harness import save_tiny_served_model
from .router_harness import launch

REQUESTS, CONCURRENCY, LIMIT = 300, 200, 128
# Long enough that admitted requests still hold their permits while the rest
# of the 200 clients connect: with 8 tokens, a slow accept loop (a busy CI
# machine) let early requests finish first, and fewer than 72 heard 429.
BODY = dict(BODY, parameters=dict(BODY["parameters"], max_new_tokens=64))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overload")
    path = save_tiny_served_model(tmp / "tiny")
    proc, url = launch(str(path), tmp, "--max-concurrent-requests", str(LIMIT),
                       "--max-total-tokens", "256", "--max-input-tokens", "200")
    yield proc, url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def test_overload_rejects_the_excess_fast_and_finishes_the_rest(server):
    proc, url = server
    warm = asyncio.run(overload(url, LIMIT, LIMIT))  # every permit used once: the router's steady state
    assert warm.ok == LIMIT
    rss_before = rss_bytes(proc.pid)
    before = {name: metric(url, name) for name in ("tgi_request_success", 'tgi_request_failure{err="overloaded"}')}

    result = asyncio.run(overload(url, REQUESTS, CONCURRENCY, BODY))

    assert result.other == {} and result.ok + result.rejected == REQUESTS
    assert result.ok >= LIMIT and result.rejected >= CONCURRENCY - LIMIT
    # A rejection waits for nothing but its turn on the event loop; service waits for 64 steps.
    assert result.reject_p50_ms < result.ok_p50_ms
    assert metric(url, "tgi_request_success") - before["tgi_request_success"] == result.ok
    assert metric(url, 'tgi_request_failure{err="overloaded"}') - before[
        'tgi_request_failure{err="overloaded"}'] == result.rejected
    assert metric(url, "tgi_queue_size") == 0
    assert metric(url, "tgi_kv_cache_blocks_free") == metric(url, "tgi_kv_cache_blocks_capacity")
    assert rss_bytes(proc.pid) <= 1.10 * rss_before
