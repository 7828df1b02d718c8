"""TGI's HTTP routes: /generate, /generate_stream, /, /health, /info,
/metrics, /tokenize (and FastAPI's /docs with the OpenAPI spec); the OpenAI
routes come from openai_api, the browsers' playground page from playground."""

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from . import protocol as p
from .admission import Admitted, ApiSettings, Gate, ServerState
from .api_key import ApiKeyMiddleware
from .engine import Engine
from .errors import (BodyDeserializeError, BodySyntaxError, GenerationError, RouteError, TGIError, UnhealthyError,
                     error_response)
from .openai_api import add_openai_routes
from .payload_limit import PayloadLimitMiddleware
from .playground import PlaygroundMiddleware
from .request_stream import ErrorEvent, RequestStream
from .responses import generate_response, stream_response, stream_token_event, timing_headers
from .validation import check_input_chars, tokenize_text, validate

__all__ = ["ApiSettings", "ServerState", "create_app"]


def create_app(engine: Engine, settings: ApiSettings, metrics, state: ServerState) -> FastAPI:
    # TGI serves its OpenAPI spec at /api-doc/openapi.json and Swagger UI at /docs.
    app = FastAPI(title="Text Generation Inference", version=settings.info.version,
                  openapi_url="/api-doc/openapi.json", docs_url="/docs", redoc_url=None)
    # The last added runs first: the playground's static page and files (they
    # need no key), CORS (answers preflights), then the API key (before any
    # body is read), then the payload limit.
    app.add_middleware(PayloadLimitMiddleware, limit=settings.payload_limit)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, protect_metrics=settings.protect_metrics)
    if settings.cors_allow_origin:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_allow_origin),
                           allow_methods=["*"], allow_headers=["*"])
    if settings.playground:
        app.add_middleware(PlaygroundMiddleware)

    @app.exception_handler(TGIError)
    async def _tgi_error(request: Request, err: TGIError):
        status, body = error_response(err)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:])
        detail = f"{where}: {first.get('msg', 'invalid body')}" if where else first.get("msg", "invalid body")
        cls = BodySyntaxError if first.get("type") == "json_invalid" else BodyDeserializeError
        status, body = error_response(cls(detail))
        return JSONResponse(body, status_code=status)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, err: HTTPException):
        status, body = error_response(RouteError(err.status_code, str(err.detail)))
        return JSONResponse(body, status_code=status, headers=err.headers)

    gate = Gate(engine, settings, metrics, state)

    def tgi_request(body: p.GenerateRequest, stream: bool):
        return lambda: [validate(body, engine.tokenizer.encode, settings.limits, stream=stream,
                                count_tokens=lambda t: len(engine.tokenizer.encode(t, add_special_tokens=False)))]

    async def generate(request: Request, body: p.GenerateRequest) -> RequestStream:
        admitted = await gate.admit(tgi_request(body, stream=False))
        try:
            await gate.wait(request, admitted)
        finally:
            admitted.close()
        return admitted.streams[0]

    async def sse(body: p.GenerateRequest) -> StreamingResponse:
        admitted = await gate.admit(tgi_request(body, stream=True))
        headers = {"x-compute-type": settings.compute_type, "x-accel-buffering": "no", "cache-control": "no-cache"}
        return StreamingResponse(_tgi_events(gate, admitted), media_type="text/event-stream", headers=headers)

    @app.post("/generate", response_model=p.GenerateResponse, tags=["Text Generation Inference"])
    async def generate_route(request: Request, body: p.CompatGenerateRequest):
        """Generate tokens (a top-level `"stream": true` answers as /generate_stream)."""
        if body.stream:
            return await sse(body.to_generate_request())
        stream = await generate(request, body.to_generate_request())
        return JSONResponse(generate_response(stream).model_dump(mode="json"),
                            headers=timing_headers(stream, settings.compute_type))

    @app.post("/generate_stream", tags=["Text Generation Inference"])
    async def generate_stream_route(body: p.GenerateRequest):
        """Generate tokens as server-sent events."""
        return await sse(body)

    @app.post("/", tags=["Text Generation Inference"])
    async def compat_route(request: Request, body: p.CompatGenerateRequest):
        """TGI's compatibility route: /generate_stream when `stream`, else a list of one response."""
        if body.stream:
            return await sse(body.to_generate_request())
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
    async def tokenize(body: p.GenerateRequest):
        """The tokens of `inputs` (refused, untokenized, when too long to serve)."""
        check_input_chars(body.inputs, settings.limits)
        tokens = await asyncio.to_thread(tokenize_text, engine.tokenizer, body.inputs)
        return JSONResponse([p.SimpleToken(id=i, text=t, start=a, stop=b).model_dump() for i, t, a, b in tokens])

    add_openai_routes(app, gate)
    return app


async def _tgi_events(gate: Gate, admitted: Admitted) -> AsyncIterator[bytes]:
    """/generate_stream's SSE events; a failure is the last event, as TGI."""
    stream = admitted.streams[0]
    try:
        index = 0
        async for _, event in gate.events(admitted):
            if isinstance(event, ErrorEvent):
                _, err = error_response(GenerationError(
                    event.message.removeprefix("Request failed during generation: ")))
                yield b"data:" + json.dumps(err).encode() + b"\n\n"
                return
            index += 1
            yield stream_token_event(event, index) or (
                b"data:" + stream_response(stream, event, index).model_dump_json().encode() + b"\n\n")
    finally:
        admitted.close()
