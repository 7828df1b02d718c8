"""TGI's HTTP routes: /generate, /generate_stream, /, /health, /info,
/metrics, /tokenize (and FastAPI's /docs with the OpenAPI spec)."""

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import protocol as p
from .engine import Engine
from .errors import (BodyDeserializeError, GenerationError, OverloadedError, TGIError,
                     UnauthorizedError, UnhealthyError, error_response)
from .payload_limit import PayloadLimitMiddleware
from .request_stream import ErrorEvent, RequestStream, Timings
from .responses import generate_response, stream_response, timing_headers
from .validation import ValidationLimits, validate


@dataclass(frozen=True)
class ApiSettings:
    info: p.Info
    limits: ValidationLimits
    max_concurrent_requests: int
    api_key: str | None
    cors_allow_origin: tuple[str, ...]
    payload_limit: int
    compute_type: str          # "cpu", "gpu+optimized", ... (TGI's x-compute-type)


class ServerState:
    """What /health reports and what admission checks."""

    def __init__(self):
        self.draining = False
        self.in_flight = 0


def create_app(engine: Engine, settings: ApiSettings, metrics, state: ServerState) -> FastAPI:
    # TGI serves its OpenAPI spec at /api-doc/openapi.json and Swagger UI at /docs.
    app = FastAPI(title="Text Generation Inference", version=settings.info.version,
                  openapi_url="/api-doc/openapi.json", docs_url="/docs", redoc_url=None)
    if settings.cors_allow_origin:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_allow_origin),
                           allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(PayloadLimitMiddleware, limit=settings.payload_limit)

    @app.exception_handler(TGIError)
    async def _tgi_error(request: Request, err: TGIError):
        status, body = error_response(err)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:])
        detail = f"{where}: {first.get('msg', 'invalid body')}" if where else first.get("msg", "invalid body")
        status, body = error_response(BodyDeserializeError(detail))
        return JSONResponse(body, status_code=status)

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), settings.api_key.encode()):
            raise UnauthorizedError()

    async def admit(request: Request, body: p.GenerateRequest, stream: bool) -> tuple[RequestStream, Timings]:
        authorize(request)
        timings = Timings(arrival=time.perf_counter())
        metrics.request_received()
        if state.draining or not engine.healthy:
            metrics.request_failed("dropped")
            raise UnhealthyError()
        if state.in_flight >= settings.max_concurrent_requests:
            metrics.request_failed("overloaded")
            raise OverloadedError()
        state.in_flight += 1  # held from here until the response ends
        try:
            valid = await asyncio.to_thread(validate, body, engine.tokenizer.encode, settings.limits, stream=stream)
        except BaseException as err:
            state.in_flight -= 1
            if isinstance(err, TGIError):
                metrics.request_failed("validation")
            raise
        timings.validated = time.perf_counter()
        metrics.request_validated(valid.input_length, valid.stopping.max_total_new_tokens)
        return engine.submit(valid, timings), timings

    async def generate(request: Request, body: p.GenerateRequest) -> RequestStream:
        stream, timings = await admit(request, body, stream=False)
        watcher = asyncio.ensure_future(_watch_disconnect(request))
        try:
            while (event := await _next_or_disconnect(stream, watcher)) is not None:
                if isinstance(event, ErrorEvent):
                    metrics.request_failed("generation")
                    raise GenerationError(event.message.removeprefix("Request failed during generation: "))
            _finished(metrics, stream)
            return stream
        finally:
            watcher.cancel()
            state.in_flight -= 1
            if stream.timings.finished == 0:
                engine.cancel(stream)

    async def sse(request: Request, body: p.GenerateRequest) -> StreamingResponse:
        stream, _ = await admit(request, body, stream=True)
        previous = 0.0

        async def events() -> AsyncIterator[bytes]:
            nonlocal previous
            index = 0
            try:
                while (event := await stream.events.get()) is not None:
                    if isinstance(event, ErrorEvent):
                        metrics.request_failed("generation")
                        _, err = error_response(GenerationError(
                            event.message.removeprefix("Request failed during generation: ")))
                        yield b"data:" + json.dumps(err).encode() + b"\n\n"
                        return
                    index += 1
                    if index > 1:
                        metrics.inter_token(stream.timings.last_token - previous)
                    else:
                        metrics.first_token(stream.timings.first_token - stream.timings.arrival)
                    previous = stream.timings.last_token
                    yield b"data:" + stream_response(stream, event, index).model_dump_json().encode() + b"\n\n"
                _finished(metrics, stream)
            finally:
                state.in_flight -= 1
                if stream.timings.finished == 0:
                    engine.cancel(stream)  # the client went away: free its blocks now
        headers = {"x-compute-type": settings.compute_type, "x-accel-buffering": "no", "cache-control": "no-cache"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    @app.post("/generate", response_model=p.GenerateResponse, tags=["Text Generation Inference"])
    async def generate_route(request: Request, body: p.CompatGenerateRequest):
        """Generate tokens (a top-level `"stream": true` answers as /generate_stream)."""
        if body.stream:
            return await sse(request, body.to_generate_request())
        stream = await generate(request, body.to_generate_request())
        return JSONResponse(generate_response(stream).model_dump(mode="json"),
                            headers=timing_headers(stream, settings.compute_type))

    @app.post("/generate_stream", tags=["Text Generation Inference"])
    async def generate_stream_route(request: Request, body: p.GenerateRequest):
        """Generate tokens as server-sent events."""
        return await sse(request, body)

    @app.post("/", tags=["Text Generation Inference"])
    async def compat_route(request: Request, body: p.CompatGenerateRequest):
        """TGI's compatibility route: /generate_stream when `stream`, else a list of one response."""
        if body.stream:
            return await sse(request, body.to_generate_request())
        stream = await generate(request, body.to_generate_request())
        return JSONResponse([generate_response(stream).model_dump(mode="json")],
                            headers=timing_headers(stream, settings.compute_type))

    @app.get("/health", tags=["Text Generation Inference"])
    async def health():
        """200 when the shards can serve, 503 otherwise."""
        if not engine.healthy or state.draining:
            raise UnhealthyError()
        return Response(status_code=200)

    @app.get("/info", response_model=p.Info, tags=["Text Generation Inference"])
    async def info():
        return JSONResponse(settings.info.model_dump(mode="json"))

    @app.get("/metrics", tags=["Text Generation Inference"])
    async def metrics_route():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/tokenize", response_model=p.TokenizeResponse, tags=["Text Generation Inference"])
    async def tokenize(request: Request, body: p.GenerateRequest):
        authorize(request)
        tokens = engine.tokenizer.encode_with_offsets(body.inputs)
        return JSONResponse([p.SimpleToken(id=i, text=t, start=a, stop=b).model_dump() for i, t, a, b in tokens])

    return app


def _finished(metrics, stream: RequestStream) -> None:
    t = stream.timings
    metrics.request_finished(total_s=t.finished - t.arrival, validation_s=t.validated - t.arrival,
                             queue_s=(t.first_scheduled or t.queued) - t.queued,
                             inference_s=t.finished - (t.first_scheduled or t.queued),
                             generated_tokens=stream.generated_tokens)


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)


async def _next_or_disconnect(stream: RequestStream, watcher: asyncio.Future):
    """The stream's next event; raises CancelledError when the client left."""
    getter = asyncio.ensure_future(stream.events.get())
    done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if getter in done:
        return getter.result()
    getter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await getter
    raise asyncio.CancelledError("client disconnected")
