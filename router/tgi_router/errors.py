"""Typed errors of the router and their one mapping to TGI's HTTP answer.

Each error class carries TGI's status code, `error_type` and message format
(TGI router/src/infer/mod.rs `InferError`, router/src/server.rs). Routes raise
these; `error_response` turns any of them into `(status, {"error",
"error_type"})`. A streaming route sends the same body as an SSE `data:` event
(TGI keeps status 200 once the stream has started).

Where TGI answers without its JSON body, `tgi_body` says so: "text" (axum
rejections; TGI's body is exactly `message`, text/plain) or "empty" (401).
`error_response` still gives a JSON body for them; a route that wants TGI's
exact bytes sends `message` as text/plain, or nothing, instead.
"""

from typing import ClassVar, Literal


class TGIError(Exception):
    """Base of every error a client may see. `detail` fills the `{}` of
    `template`; `message` is what TGI puts in `"error"`."""
    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal"
    template: ClassVar[str] = "{}"
    tgi_body: ClassVar[Literal["json", "text", "empty"]] = "json"

    def __init__(self, detail: str = ""):
        super().__init__(detail)
        self.detail = detail

    @property
    def message(self) -> str:
        return self.template.format(self.detail)


class ValidationError(TGIError):
    """A request TGI's validation rejects; `detail` is the rule's message,
    e.g. "`temperature` must be strictly positive"."""
    status = 422
    error_type = "validation"
    template = "Input validation error: {}"


class BatchSizeExceededError(TGIError):
    """More prompts in one /v1/completions request than max_client_batch_size:
    each would be a sequence, past --max-concurrent-requests' count."""
    status = 422
    error_type = "batch size exceeded"
    template = "Number of prompts exceeds the maximum allowed batch size of {}"


class OverloadedError(TGIError):
    """No permit left under --max-concurrent-requests."""
    status = 429
    error_type = "overloaded"
    template = "Model is overloaded"


class GenerationError(TGIError):
    """A shard failed while generating; `detail` is its one-line reason."""
    status = 424
    error_type = "generation"
    template = "Request failed during generation: {}"


class TemplateError(TGIError):
    """The chat template failed to render."""
    status = 422
    error_type = "template_error"
    template = "Template error: {}"


class ToolError(TGIError):
    status = 422
    error_type = "tool_error"
    template = "Tool error: {}"


class UnhealthyError(TGIError):
    """`/health` when a shard is down."""
    status = 503
    error_type = "healthcheck"
    template = "unhealthy"


class UnauthorizedError(TGIError):
    """Missing or wrong `Authorization: Bearer <api key>`; TGI sends 401
    with an empty body."""
    status = 401
    error_type = "unauthorized"
    template = "Unauthorized"
    tgi_body = "empty"


class PayloadTooLargeError(TGIError):
    """Body over --payload-limit (TGI's default 2,000,000 bytes); axum's
    text. This limit is also what bounds tokenization work per request."""
    status = 413
    error_type = "payload_too_large"
    template = "Failed to buffer the request body: length limit exceeded"
    tgi_body = "text"


class BodyDeserializeError(TGIError):
    """Valid JSON of the wrong shape (missing `inputs`, a string for a
    number, null for a bool...). `detail` cannot match serde's wording."""
    status = 422
    error_type = "deserialize"
    template = "Failed to deserialize the JSON body into the target type: {}"
    tgi_body = "text"


class BodySyntaxError(TGIError):
    """A body that is not JSON."""
    status = 400
    error_type = "json_syntax"
    template = "Failed to parse the request body as JSON: {}"
    tgi_body = "text"


class MissingJsonContentTypeError(TGIError):
    """A body sent without a JSON Content-Type (application/json or
    application/*+json)."""
    status = 415
    error_type = "content_type"
    template = "Expected request with `Content-Type: application/json`"
    tgi_body = "text"


class RouteError(TGIError):
    """The web framework's own refusals (404 no such route, 405 wrong method,
    400 a body it cannot read: invalid UTF-8, nesting deeper than the
    parser's recursion limit), given TGI's body shape with their status."""
    error_type = "http"

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status


def error_response(err: TGIError) -> tuple[int, dict[str, str]]:
    """The one mapping from a typed error to TGI's status and body."""
    return err.status, {"error": err.message, "error_type": err.error_type}
