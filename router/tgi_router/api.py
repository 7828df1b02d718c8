"""TGI's HTTP routes: /generate, /generate_stream, /, /health, /info,
/metrics, /tokenize (and FastAPI's /docs with the OpenAPI spec); the OpenAI
routes come from openai_api."""

import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import protocol as p
from .admission import Admitted, ApiSettings, Gate, ServerState
from .engine import Engine
from .errors import BodyDeserializeError, GenerationError, TGIError, UnhealthyError, error_response
from .openai_api import add_openai_routes
from .payload_limit import PayloadLimitMiddleware
from .request_stream import ErrorEvent, RequestStream
from .responses import generate_response, stream_response, timing_headers
from .validation import validate

__all__ = ["ApiSettings", "ServerState", "create_app"]


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

    gate = Gate(engine, settings, metrics, state)

    def tgi_request(body: p.GenerateRequest, stream: bool):
        return lambda: [validate(body, engine.tokenizer.encode, settings.limits, stream=stream)]

    async def generate(request: Request, body: p.GenerateRequest) -> RequestStream:
        admitted = await gate.admit(request, tgi_request(body, stream=False))
        try:
            await gate.wait(request, admitted)
        finally:
            admitted.close()
        return admitted.streams[0]

    async def sse(request: Request, body: p.GenerateRequest) -> StreamingResponse:
        admitted = await gate.admit(request, tgi_request(body, stream=True))
        headers = {"x-compute-type": settings.compute_type, "x-accel-buffering": "no", "cache-control": "no-cache"}
        return StreamingResponse(_tgi_events(gate, admitted), media_type="text/event-stream", headers=headers)

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
        gate.authorize(request)
        tokens = engine.tokenizer.encode_with_offsets(body.inputs)
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
            yield b"data:" + stream_response(stream, event, index).model_dump_json().encode() + b"\n\n"
    finally:
        admitted.close()
