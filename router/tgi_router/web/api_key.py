"""--api-key, checked before anything else reads the request: a client
without the key learns nothing from a route (no body parsing, no 422 for a
bad body, no tokenization), whatever route or method it tries.

Every path needs `Authorization: Bearer <key>` except the open ones: TGI's
/health, /metrics and /info, /v1/models, and the OpenAPI spec and docs.
With --protect-metrics (ours), /metrics and /info need the key too;
/health stays open for load balancers' probes. The comparison is
hmac.compare_digest on bytes: its time does not depend on where a wrong key
first differs. CORS preflights (OPTIONS with an Origin) carry no
credentials by design and are answered by the CORS middleware, which runs
before this one.
"""

import hmac
import json

from tgi_router.errors import UnauthorizedError, error_response

__all__ = ["ApiKeyMiddleware", "OPEN_PATHS"]

OPEN_PATHS = frozenset({"/health", "/metrics", "/info", "/v1/models", "/docs", "/docs/oauth2-redirect",
                        "/api-doc/openapi.json"})
_METRICS_PATHS = frozenset({"/metrics", "/info"})


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str, protect_metrics: bool = False):
        self.app = app
        self.expected = b"Bearer " + api_key.encode()
        self.open = OPEN_PATHS - _METRICS_PATHS if protect_metrics else OPEN_PATHS

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open or self._authorized(scope):
            return await self.app(scope, receive, send)
        status, body = error_response(UnauthorizedError())
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": payload})

    def _authorized(self, scope) -> bool:
        given = b""
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                given = value.strip()
                break
        return hmac.compare_digest(given, self.expected)
