"""TGI's HTTP routes: /generate, /generate_stream, /, /health, /info,
/metrics, /tokenize (tgi_router.app puts them, OpenAI's routes and the
middleware on one FastAPI application)."""

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tgi_router.errors import GenerationError, UnhealthyError, error_response
from tgi_router.request import protocol as p
from tgi_router.request.validation import check_input_chars, tokenize_text, validate
from tgi_router.scheduling.engine import Engine
from tgi_router.scheduling.request_stream import ErrorEvent, RequestStream
from tgi_router.tgi_api.responses import generate_response, stream_response, stream_token_event, timing_headers
from tgi_router.web.admission import Admitted, ApiSettings, Gate, ServerState


def add_tgi_routes(app: FastAPI, gate: Gate, engine: Engine, settings: ApiSettings, metrics,
                   state: ServerState) -> None:
    """TGI's routes on `app`: /generate, /generate_stream, / (compat), /health,
    /info, /metrics and /tokenize, admitting generations through `gate`."""

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
