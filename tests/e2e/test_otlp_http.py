"""--otlp-endpoint: the router's spans reach a real OTLP/gRPC receiver (the
opentelemetry protocol's own service, served in-process): a root span per
request named after its route, continuing the caller's W3C traceparent,
with validate, queue, inference, response and one step span per step as
its children; with the receiver gone, requests still succeed and the
spans that could not be sent are counted."""

import re
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from ..shard_harness import save_tiny_model, save_tiny_tokenizer
from .router_harness import free_port, launch

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
NEW_TOKENS = 6


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span it is sent, with its resource's service.name."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    self.spans.extend((attrs.get("service.name"), span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, roots: set[str], timeout: float = 20.0) -> list:
        """The spans, once each named root and all of its children (the four
        phases and a step per token) are in: children end before their root
        but may travel in a later batch."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self.lock:
                if all(_complete(name, self.spans) for name in roots):
                    return list(self.spans)
            time.sleep(0.2)
        raise AssertionError(f"spans of {roots} not all received: {[s.name for _, s in self.spans]}")


def _complete(root_name: str, spans: list) -> bool:
    roots = [span for _, span in spans if span.name == root_name]
    if not roots:
        return False
    names = [span.name for _, span in spans if span.parent_span_id == roots[0].span_id]
    return {"validate", "queue", "inference", "response"} <= set(names) and names.count("step") >= NEW_TOKENS


@pytest.fixture
def receiver():
    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    collected = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collected, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield port, collected, server
    server.stop(0)


def _metric(url: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", httpx.get(url + "/metrics").text, re.M).group(1))


def test_spans_of_a_streamed_and_a_plain_request_and_none_lost_silently(receiver, tmp_path):
    port, collected, server = receiver
    path = save_tiny_model("llama", tmp_path / "model", vocab_size=320, bos_token_id=256, eos_token_id=None)
    save_tiny_tokenizer(path)
    proc, url = launch(str(path), tmp_path, "--otlp-endpoint", f"http://127.0.0.1:{port}",
                       "--otlp-service-name", "tgi-test")
    try:
        body = {"inputs": "Hello there", "parameters": {"max_new_tokens": NEW_TOKENS}}
        r = httpx.post(url + "/generate", json=body, timeout=60,
                       headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        assert r.status_code == 200
        with httpx.stream("POST", url + "/generate_stream", json=body, timeout=60) as s:
            assert s.status_code == 200 and sum(1 for line in s.iter_lines() if line.startswith("data:")) == NEW_TOKENS
        spans = collected.wait_for({"generate", "generate_stream"})
        assert {service for service, _ in spans} == {"tgi-test"}
        roots = {span.name: span for _, span in spans if span.name in ("generate", "generate_stream")}
        plain, streamed = roots["generate"], roots["generate_stream"]
        assert plain.trace_id.hex() == TRACE_ID and plain.parent_span_id.hex() == PARENT_ID  # the caller's trace
        assert streamed.trace_id.hex() != TRACE_ID and not streamed.parent_span_id  # a trace of its own
        for root in (plain, streamed):
            children = [span for _, span in spans if span.parent_span_id == root.span_id]
            names = [span.name for span in children]
            assert {"validate", "queue", "inference", "response"} <= set(names)
            assert names.count("step") >= NEW_TOKENS  # the prefill, then a decode step per token
            assert all(span.trace_id == root.trace_id for span in children)
            assert all(root.start_time_unix_nano <= span.start_time_unix_nano
                       and span.end_time_unix_nano <= root.end_time_unix_nano for span in children)
            step = next(span for span in children if span.name == "step")
            attrs = {a.key: a.value.int_value for a in step.attributes}
            assert attrs["batch_size"] >= 1 and attrs["tokens"] >= 1
            status = {a.key: a.value.int_value for a in root.attributes}["http.response.status_code"]
            assert status == 200
        assert _metric(url, "tgi_otlp_spans_exported") >= len(spans)

        server.stop(0)  # the collector goes away: requests still succeed, spans are counted as dropped
        for _ in range(2):
            assert httpx.post(url + "/generate", json=body, timeout=60).status_code == 200
        deadline = time.time() + 30
        while _metric(url, "tgi_otlp_spans_dropped") == 0 and time.time() < deadline:
            time.sleep(0.5)
        assert _metric(url, "tgi_otlp_spans_dropped") > 0
    finally:
        proc.terminate()
        proc.wait(30)


def test_without_an_endpoint_the_tracing_sdk_is_never_imported():
    code = ("import sys, tgi_router.launch.server, tgi_router.launch.launcher; "
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
