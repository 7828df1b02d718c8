"""The web playground (ours; --disable-playground turns it off): a chat page
served at `GET /` to browsers, whose script streams answers from
/v1/chat/completions.

`PlaygroundMiddleware` answers only a `GET /` whose Accept header prefers
text/html (what a browser sends when it opens the address) and `GET` of the
page's own files under /playground/; every other request, `POST /` and a
`GET /` from an API client included, reaches the routes as before. It runs
outside the API key middleware: the page and its files are static and hold
nothing of the server, so they load without a key; the page sends the key
that its user types on every call it makes.

The files are plain HTML, CSS and JavaScript shipped in the package
(static/playground/), read once when the app is built. Each answer carries a
Content-Security-Policy that allows the page's own origin only, with no
inline script or style, so model output can never run as code (the script
also renders it with textContent only).
"""

from __future__ import annotations

from importlib import resources

__all__ = ["PlaygroundMiddleware", "prefers_html", "CONTENT_SECURITY_POLICY", "ASSET_PREFIX"]

CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                           "img-src 'self' data:; base-uri 'none'; frame-ancestors 'none'; form-action 'none'")
ASSET_PREFIX = "/playground/"
_TYPES = {".html": b"text/html; charset=utf-8", ".js": b"text/javascript; charset=utf-8",
          ".css": b"text/css; charset=utf-8"}
_PAGE = "index.html"


class PlaygroundMiddleware:
    """ASGI: serves the playground's page and files; passes everything else on."""

    def __init__(self, app):
        self.app = app
        root = resources.files(__package__).joinpath("static", "playground")
        # path -> (content type, body); the page itself is only reached through "/"
        self.files = {("/" if f.name == _PAGE else ASSET_PREFIX + f.name): (_TYPES[_suffix(f.name)], f.read_bytes())
                      for f in root.iterdir() if _suffix(f.name) in _TYPES}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "GET" or scope["path"] not in self.files:
            return await self.app(scope, receive, send)
        if scope["path"] == "/" and not prefers_html(_header(scope, b"accept")):
            return await self.app(scope, receive, send)
        content_type, body = self.files[scope["path"]]
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                   (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
                   (b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer"),
                   (b"cache-control", b"no-cache")]
        if scope["path"] == "/":
            headers.append((b"vary", b"accept"))  # the same URL answers API clients with 405
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def prefers_html(accept: str) -> bool:
    """Accept names text/html (q > 0) at least as high as application/json
    (named, or through application/* or */*). A bare */* (curl, fetch, API
    clients) is no preference for HTML."""
    weights: dict[str, float] = {}
    for part in accept.split(","):
        media, *params = (s.strip() for s in part.split(";"))
        weight = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    weight = float(value)
                except ValueError:
                    weight = 0.0
        if media:
            weights[media.lower()] = weight
    html = weights.get("text/html", 0.0)
    json = next((weights[m] for m in ("application/json", "application/*", "*/*") if m in weights), 0.0)
    return html > 0 and html >= json


def _header(scope, name: bytes) -> str:
    for key, value in scope.get("headers") or ():
        if key == name:
            return value.decode("latin-1")
    return ""


def _suffix(name: str) -> str:
    return name[name.rfind("."):] if "." in name else ""
