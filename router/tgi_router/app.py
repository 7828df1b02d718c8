"""The router's FastAPI application: middleware (the playground, CORS, the
API key, the payload limit), TGI's error answers for every failure, then
TGI's routes and OpenAI's over one admission gate."""

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tgi_router.errors import (
    BodyDeserializeError,
    BodySyntaxError,
    MissingJsonContentTypeError,
    RouteError,
    TGIError,
    error_response,
)
from tgi_router.openai_compat.routes import add_openai_routes
from tgi_router.scheduling.engine import Engine
from tgi_router.tgi_api.routes import add_tgi_routes
from tgi_router.web.admission import ApiSettings, Gate, ServerState
from tgi_router.web.api_key import ApiKeyMiddleware
from tgi_router.web.payload_limit import PayloadLimitMiddleware
from tgi_router.web.playground import PlaygroundMiddleware


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
        # TGI's JSON extractor checks the content type before the body; FastAPI
        # reads a body of any other type as bytes, which then fail validation.
        if not is_json(request.headers.get("content-type", "")):
            status, body = error_response(MissingJsonContentTypeError())
            return JSONResponse(body, status_code=status)
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
    add_tgi_routes(app, gate, engine, settings, metrics, state)
    add_openai_routes(app, gate)
    return app


def is_json(content_type: str) -> bool:
    """Whether a Content-Type header names JSON as TGI (axum) accepts it:
    application/json or application/<anything>+json, parameters aside."""
    kind, _, subtype = content_type.partition(";")[0].strip().lower().partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))
