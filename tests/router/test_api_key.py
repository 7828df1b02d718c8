"""--api-key is checked before any route reads the request, on every path but
the open ones, in constant time."""

import hmac

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from tgi_router.web import api_key
from tgi_router.web.api_key import OPEN_PATHS, ApiKeyMiddleware

KEY = "s3cret-key"
AUTH = {"authorization": f"Bearer {KEY}"}


def app(protect_metrics: bool = False) -> TestClient:
    async def ok(request):
        await request.body()
        return PlainTextResponse("ok")
    paths = ["/generate", "/v1/chat/completions", *OPEN_PATHS]
    inner = Starlette(routes=[Route(p, ok, methods=["GET", "POST"]) for p in paths])
    return TestClient(ApiKeyMiddleware(inner, api_key=KEY, protect_metrics=protect_metrics))


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": KEY},
                                     {"authorization": f"Basic {KEY}"}, {"authorization": f"Bearer {KEY}x"},
                                     {"authorization": "Bearer " + KEY[:-1]}])
def test_a_missing_or_wrong_key_is_401_with_tgis_shape(headers):
    r = app().post("/generate", content=b"{not even json", headers=headers)
    assert r.status_code == 401
    assert r.json() == {"error": "Unauthorized", "error_type": "unauthorized"}


def test_the_key_opens_every_route_and_unknown_paths_stay_closed():
    client = app()
    assert client.post("/generate", headers=AUTH).status_code == 200
    assert client.post("/v1/chat/completions", headers=AUTH).status_code == 200
    assert client.post("/nowhere").status_code == 401


def test_health_metrics_info_models_and_docs_are_open_as_in_tgi():
    client = app()
    for path in OPEN_PATHS:
        assert client.get(path).status_code == 200, path


def test_protect_metrics_closes_metrics_and_info_but_not_health():
    client = app(protect_metrics=True)
    assert client.get("/metrics").status_code == 401 and client.get("/info").status_code == 401
    assert client.get("/metrics", headers=AUTH).status_code == 200
    assert client.get("/health").status_code == 200


def test_the_comparison_is_constant_time(monkeypatch):
    calls, original = [], hmac.compare_digest

    def compare(a, b):
        calls.append((a, b))
        return original(a, b)
    monkeypatch.setattr(api_key.hmac, "compare_digest", compare)
    app().post("/generate", headers={"authorization": "Bearer nope"})
    assert calls == [(b"Bearer nope", f"Bearer {KEY}".encode())]
