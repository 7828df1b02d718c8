"""OpenTelemetry traces of each generation request, exported over OTLP/gRPC
(--otlp-endpoint, --otlp-service-name), as TGI's router exports them.

A request is one root span named after its route, continuing the caller's
trace when the request carries a W3C `traceparent` header; its children
are `validate` (templating, tokenizing, checks), `queue` (submitted to first
scheduled), one `step` per step the request took part in (the batch size
and its tokens in that step) and, at the end, the response's attributes on
the root. Spans are built after the fact from the timings the router keeps
anyway (perf_counter, turned into epoch nanoseconds), so tracing adds no
await and no lock to a request's path.

Export runs on a thread of its own: spans wait in a bounded queue and go out
in batches; when the collector is down or slow, the queue fills and spans
are dropped, never the request, and `tgi_otlp_spans_dropped` counts them.
Without --otlp-endpoint this module is not imported, and nothing is.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tgi_router.web.admission import request_span

log = logging.getLogger("tgi_router")

QUEUE_SPANS = 8192        # spans waiting for export before new ones are dropped
BATCH_SPANS = 512         # spans per export call
FLUSH_SECONDS = 1.0       # a batch goes out at least this often
EXPORT_TIMEOUT = 5.0      # seconds one export may retry before its spans count as dropped

# Generation routes -> their root span's name (TGI's handler names).
ROUTES = {"/generate": "generate", "/generate_stream": "generate_stream", "/": "compat_generate",
          "/v1/chat/completions": "chat_completions", "/v1/completions": "completions"}


class Tracing:
    """The tracer of one router; `metrics` counts exported and dropped spans."""

    def __init__(self, endpoint: str, service_name: str, metrics, exporter: SpanExporter | None = None):
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.processor = _QueuedExport(exporter or OTLPSpanExporter(endpoint=endpoint, insecure=_insecure(endpoint),
                                                                    timeout=EXPORT_TIMEOUT), metrics)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("tgi_router")
        self._propagator = TraceContextTextMapPropagator()
        # perf_counter seconds -> epoch nanoseconds (OTLP timestamps)
        self._epoch_offset_ns = time.time_ns() - time.perf_counter_ns()

    def epoch_ns(self, perf_seconds: float) -> int:
        return int(perf_seconds * 1e9) + self._epoch_offset_ns

    def start(self, route: str, headers: Mapping[str, str], start: float) -> RequestSpan:
        """The root span of a request to `route` that arrived at perf_counter
        `start`, a child of the caller's span when `headers` has a traceparent."""
        parent = self._propagator.extract(carrier=headers)
        span = self.tracer.start_span(route, context=parent, kind=trace.SpanKind.SERVER,
                                      start_time=self.epoch_ns(start), attributes={"http.route": route})
        return RequestSpan(self, span)

    def shutdown(self) -> None:
        """Exports the spans still queued (waiting at most one export's timeout), then stops."""
        self.provider.shutdown()


class RequestSpan:
    """One request's root span; children are recorded with explicit times."""

    def __init__(self, tracing: Tracing, span: trace.Span):
        self.tracing = tracing
        self.span = span
        self._context = trace.set_span_in_context(span)

    def child(self, name: str, start: float, end: float, **attributes) -> None:
        """A finished child span from perf_counter `start` to `end`."""
        to_ns = self.tracing.epoch_ns
        span = self.tracing.tracer.start_span(name, context=self._context, start_time=to_ns(start),
                                              attributes=attributes)
        span.end(end_time=to_ns(max(start, end)))

    def end(self, status_code: int, **attributes) -> None:
        self.span.set_attribute("http.response.status_code", status_code)
        for key, value in attributes.items():
            self.span.set_attribute(key, value)
        if status_code >= 500:
            self.span.set_status(trace.StatusCode.ERROR)
        self.span.end()


class _QueuedExport(SpanProcessor):
    """Finished spans into a bounded queue; a daemon thread exports them in
    batches. A full queue or a failed export drops spans (counted)."""

    def __init__(self, exporter: SpanExporter, metrics):
        self.exporter = exporter
        self.metrics = metrics
        self._queue: queue.Queue[ReadableSpan | None] = queue.Queue(QUEUE_SPANS)
        self._thread = threading.Thread(target=self._run, name="otlp-export", daemon=True)
        self._thread.start()

    def on_end(self, span: ReadableSpan) -> None:
        try:
            self._queue.put_nowait(span)
        except queue.Full:
            self.metrics.otlp_spans(dropped=1)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch: list[ReadableSpan] = []
            deadline = time.monotonic() + FLUSH_SECONDS
            while len(batch) < BATCH_SPANS:
                try:
                    span = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if span is None:
                    stopping = True
                    break
                batch.append(span)
            if batch:
                self._export(batch)

    def _export(self, batch: list[ReadableSpan]) -> None:
        try:
            ok = self.exporter.export(batch) == SpanExportResult.SUCCESS
        except Exception as err:  # an exporter bug must not end the thread
            log.warning("OTLP export raised %s: %s", type(err).__name__, err)
            ok = False
        if ok:
            self.metrics.otlp_spans(exported=len(batch))
        else:
            self.metrics.otlp_spans(dropped=len(batch))

    def shutdown(self) -> None:
        self._queue.put(None)  # after the spans already queued
        self._thread.join(EXPORT_TIMEOUT + FLUSH_SECONDS + 1)
        self.exporter.shutdown()


class TracingMiddleware:
    """ASGI: a root span around each generation request, from its arrival
    until its response's last byte, made the task's `request_span` so that
    admission (admission.Gate) hangs the request's other spans under it."""

    def __init__(self, app, tracing: Tracing):
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope, receive, send):
        name = ROUTES.get(scope.get("path", "")) if scope["type"] == "http" and scope["method"] == "POST" else None
        if name is None:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        span = self.tracing.start(name, headers, time.perf_counter())
        status, started = 500, None  # unless a response starts

        async def send_and_note(message):
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], time.perf_counter()
            await send(message)

        token = request_span.set(span)
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            request_span.reset(token)
            if started is not None:  # from the status line to the last byte (a stream's whole life)
                span.child("response", started, time.perf_counter(), status_code=status)
            span.end(status)


def _insecure(endpoint: str) -> bool:
    """TGI's endpoints look like http://collector:4317: plaintext unless https."""
    return not endpoint.startswith("https://")
