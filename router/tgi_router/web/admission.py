"""What every generation route shares: admission under
--max-concurrent-requests, validation off the event loop, submission to the
engine, reading events (one stream or several interleaved), request
metrics, and cancelling what a departed client leaves behind. (The API key
is checked before any route, by api_key.ApiKeyMiddleware.)"""

import asyncio
import contextvars
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request

from tgi_router.errors import GenerationError, OverloadedError, TGIError, UnhealthyError
from tgi_router.request import protocol as p
from tgi_router.request.validation import ValidationLimits, ValidGenerateRequest
from tgi_router.scheduling.engine import Engine
from tgi_router.scheduling.request_stream import ErrorEvent, RequestStream, StreamEvent, Timings
from tgi_router.text.reasoning import ReasoningParser

__all__ = ["ApiSettings", "ServerState", "Gate", "Admitted", "request_span"]

# The traced request's root span (tracing.RequestSpan) in the task serving
# it, set by tracing.TracingMiddleware; None when tracing is off.
request_span: contextvars.ContextVar = contextvars.ContextVar("tgi_request_span", default=None)


@dataclass(frozen=True)
class ApiSettings:
    info: p.Info
    limits: ValidationLimits
    max_concurrent_requests: int
    api_key: str | None
    cors_allow_origin: tuple[str, ...]
    payload_limit: int
    compute_type: str          # "cpu", "gpu+optimized", ... (TGI's x-compute-type)
    protect_metrics: bool = False  # with api_key: /metrics and /info need it too
    reasoning: ReasoningParser | None = None  # --reasoning-parser: thoughts apart from content
    playground: bool = True    # the chat page at GET / for browsers (off: --disable-playground)


class ServerState:
    """What /health reports and what admission checks."""

    def __init__(self):
        self.draining = False
        self.in_flight = 0


@dataclass
class Admitted:
    """One admitted HTTP request: its streams (one per choice), in order.
    `close()` must run once when the response ends, however it ends."""
    streams: list[RequestStream]
    gate: "Gate"
    closed: bool = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.gate.state.in_flight -= 1
        for stream in self.streams:
            if stream.timings.finished == 0:
                self.gate.engine.cancel(stream)  # the client left: free its blocks now


class Gate:
    def __init__(self, engine: Engine, settings: ApiSettings, metrics, state: ServerState):
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.state = state

    async def admit(self, prepare: Callable[[], list[ValidGenerateRequest]]) -> Admitted:
        """Takes a concurrency permit, runs `prepare` (templating,
        tokenizing, validating: CPU work) in a worker thread, and submits
        each request it returns as one stream."""
        arrival = time.perf_counter()
        self.metrics.request_received()
        if self.state.draining or not self.engine.healthy:
            self.metrics.request_failed("dropped")
            raise UnhealthyError()
        if self.state.in_flight >= self.settings.max_concurrent_requests:
            self.metrics.request_failed("overloaded")
            raise OverloadedError()
        self.state.in_flight += 1  # held until Admitted.close()
        self.engine.validating += 1  # an idle engine's first step waits for it (Engine.gather)
        try:
            valid = await asyncio.to_thread(prepare)
        except BaseException as err:
            self.state.in_flight -= 1
            if isinstance(err, TGIError):
                self.metrics.request_failed("validation")
            raise
        finally:
            self.engine.validating -= 1
        validated = time.perf_counter()
        trace = request_span.get()
        if trace is not None:
            trace.child("validate", arrival, validated, requests=len(valid),
                        input_tokens=sum(v.input_length for v in valid))
        streams = []
        for v in valid:
            self.metrics.request_validated(v.input_length, v.stopping.max_total_new_tokens)
            if v.adapter_id is not None:
                self.metrics.lora_request(v.adapter_id)
            streams.append(self.engine.submit(v, Timings(arrival=arrival, validated=validated), trace))
        return Admitted(streams, self)

    async def wait(self, request: Request, admitted: Admitted) -> None:
        """Until every stream has finished; GenerationError when one failed,
        CancelledError when the client disconnected first."""
        async for _, event in self.events(admitted, request):
            if isinstance(event, ErrorEvent):
                raise GenerationError(event.message.removeprefix("Request failed during generation: "))

    async def events(self, admitted: Admitted, request: Request | None = None
                     ) -> AsyncIterator[tuple[int, StreamEvent | ErrorEvent]]:
        """(stream index, event) as the streams produce them, interleaved,
        until all have ended; an ErrorEvent ends the iteration after it is
        yielded. Records token latencies and finished-request metrics. With
        `request`, a disconnect raises CancelledError (a streaming response
        learns it from its own send failing instead)."""
        streams = admitted.streams
        previous = [0.0] * len(streams)
        async with aclosing(_interleaved(streams, request)) as events:
            async for i, event in events:
                if event is None:
                    self._finished(streams[i])
                elif isinstance(event, ErrorEvent):
                    self.metrics.request_failed("generation")
                    yield i, event
                    return
                else:
                    self._token_latency(streams[i], previous, i)
                    yield i, event

    def _token_latency(self, stream: RequestStream, previous: list[float], i: int) -> None:
        t = stream.timings
        if previous[i]:
            self.metrics.inter_token(t.last_token - previous[i])
        else:
            self.metrics.first_token(t.first_token - t.arrival)
        previous[i] = t.last_token

    def _finished(self, stream: RequestStream) -> None:
        t = stream.timings
        if stream.trace is not None:
            scheduled = t.first_scheduled or t.queued
            stream.trace.child("queue", t.queued, scheduled)
            stream.trace.child("inference", scheduled, t.finished, generated_tokens=stream.generated_tokens,
                               first_token_s=t.first_token - t.arrival)
        self.metrics.request_finished(
            total_s=t.finished - t.arrival, validation_s=t.validated - t.arrival,
            queue_s=(t.first_scheduled or t.queued) - t.queued,
            inference_s=t.finished - (t.first_scheduled or t.queued),
            generated_tokens=stream.generated_tokens)


async def _interleaved(streams: list[RequestStream], request: Request | None
                       ) -> AsyncIterator[tuple[int, StreamEvent | ErrorEvent | None]]:
    """(stream index, event) from every stream's queue, each stream's end
    (None) included, until all have ended; with `request`, CancelledError
    when the client hangs up first."""
    if len(streams) == 1 and request is None:
        # The streamed request of one choice, the common case: awaiting its
        # queue alone costs a fraction of asyncio.wait's futures and sets
        # per token (and returns without suspending while events are queued).
        queue = streams[0].events
        while (event := await queue.get()) is not None:
            yield 0, event
        yield 0, None
        return
    getters = {asyncio.ensure_future(s.events.get()): i for i, s in enumerate(streams)}
    watcher = asyncio.ensure_future(_watch_disconnect(request)) if request is not None else None
    try:
        while getters:
            done, _ = await asyncio.wait(set(getters) | ({watcher} if watcher else set()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                raise asyncio.CancelledError("client disconnected")
            for getter in done:
                i = getters.pop(getter)
                event = getter.result()
                yield i, event
                if event is not None:
                    getters[asyncio.ensure_future(streams[i].events.get())] = i
    finally:
        for getter in getters:
            getter.cancel()
        if watcher is not None:
            watcher.cancel()


async def _watch_disconnect(request: Request) -> None:
    """Returns when the client hangs up. The route has read the whole body,
    so the next ASGI message is the disconnect: waiting for it costs
    nothing, where polling `is_disconnected` cost every waiting request
    ten wake-ups a second."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
