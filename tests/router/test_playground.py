"""The web playground: a browser's GET / gets the chat page, with a strict
Content-Security-Policy on it and on its files; every other request to /
(API clients' GET, POST) is answered as before; --disable-playground turns it
off; with --api-key the page and its files load without the key, while the
routes stay closed. (The page at work in a browser:
tests/e2e/test_playground_browser.py.)"""

import re
from types import SimpleNamespace

import httpx
import pytest
from starlette.testclient import TestClient

from tgi_router.app import create_app
from tgi_router.launch.config import parse_args
from tgi_router.request import protocol as p
from tgi_router.request.validation import ValidationLimits
from tgi_router.web.admission import ApiSettings, ServerState
from tgi_router.web.playground import CONTENT_SECURITY_POLICY, prefers_html

from ..e2e.router_harness import RunningServer
from ..shard_harness import save_tiny_served_model

KEY = "s3cret"
BROWSER = {"accept": "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,*/*;q=0.8"}
JSON = {"accept": "application/json"}
ASSETS = {"/playground/playground.js": "text/javascript; charset=utf-8",
          "/playground/playground.css": "text/css; charset=utf-8"}


def client(**settings) -> TestClient:
    """The router's app over an engine that is never reached (no model)."""
    info = p.Info(model_id="tiny", max_concurrent_requests=4, max_best_of=1, max_stop_sequences=4,
                  max_input_tokens=8, max_total_tokens=16, validation_workers=1, max_client_batch_size=1,
                  version="0")
    config = SimpleNamespace(chat_template="{{ messages }}", bos_token=None, eos_token=None)
    engine = SimpleNamespace(tokenizer=SimpleNamespace(config=config), healthy=True)
    api = ApiSettings(info=info, limits=ValidationLimits(max_input_tokens=8, max_total_tokens=16),
                      max_concurrent_requests=4, api_key=None, cors_allow_origin=(), payload_limit=10_000,
                      compute_type="cpu")
    return TestClient(create_app(engine, ApiSettings(**{**api.__dict__, **settings}), SimpleNamespace(),
                                 ServerState()))


@pytest.mark.parametrize("accept,html", [
    (BROWSER["accept"], True), ("text/html", True), ("application/json", False), ("*/*", False), ("", False),
    ("application/json, text/html;q=0.5", False), ("text/html;q=0", False), ("text/html, application/json", True),
    ("text/html;q=0.9, application/*;q=0.5", True), ("text/*", False)])
def test_only_an_accept_header_preferring_html_asks_for_the_page(accept, html):
    assert prefers_html(accept) is html


def test_a_browser_gets_the_page_under_a_strict_csp():
    r = client().get("/", headers=BROWSER)
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    assert r.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "script-src 'self';" in CONTENT_SECURITY_POLICY and "unsafe-inline" not in CONTENT_SECURITY_POLICY
    assert r.headers["x-content-type-options"] == "nosniff" and r.headers["vary"] == "accept"
    assert '<script src="/playground/playground.js" defer></script>' in r.text
    assert "<style" not in r.text and not re.search(r"\s(style|on[a-z]+)\s*=", r.text)


def test_the_page_has_no_inline_script_and_loads_nothing_from_elsewhere():
    page = client().get("/", headers=BROWSER).text
    assert page.count("<script") == 1 and "http://" not in page and "https://" not in page
    script = client().get("/playground/playground.js").text
    assert "innerHTML" not in script and "eval(" not in script and "http" not in script.replace("https?", "")


@pytest.mark.parametrize("path,content_type", ASSETS.items())
def test_the_pages_files_are_served_with_their_types_and_the_csp(path, content_type):
    r = client().get(path)
    assert r.status_code == 200 and r.headers["content-type"] == content_type
    assert r.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert r.headers["x-content-type-options"] == "nosniff"


def test_other_paths_under_playground_are_not_found():
    for path in ("/playground/index.html", "/playground/", "/playground/../api.py", "/playground/nope.js"):
        assert client().get(path).status_code == 404, path


@pytest.mark.parametrize("headers", [JSON, {}, {"accept": "*/*"}])
def test_an_api_clients_get_of_root_is_answered_as_before(headers):
    before, after = client(playground=False).get("/", headers=headers), client().get("/", headers=headers)
    assert after.status_code == before.status_code == 405
    assert after.json() == before.json() and after.headers["allow"] == "POST"


def test_head_and_post_of_root_are_answered_as_before():
    for kind in ({}, {"playground": False}):
        assert client(**kind).head("/", headers=BROWSER).status_code == 405
        r = client(**kind).post("/", headers=BROWSER, json={"parameters": {}})
        assert r.status_code == 422 and r.json()["error_type"] == "deserialize"


def test_disable_playground_leaves_get_root_as_tgi_answers_it():
    off = client(playground=False)
    assert off.get("/", headers=BROWSER).status_code == 405
    assert all(off.get(path).status_code == 404 for path in ASSETS)


def test_the_openapi_spec_is_the_same_with_and_without_the_playground():
    assert client().get("/api-doc/openapi.json").json() == client(playground=False).get("/api-doc/openapi.json").json()


def test_with_an_api_key_the_page_and_files_load_without_it_and_the_routes_stay_closed():
    keyed = client(api_key=KEY)
    assert keyed.get("/", headers=BROWSER).status_code == 200
    assert all(keyed.get(path).status_code == 200 for path in ASSETS)
    assert keyed.get("/", headers=JSON).status_code == 401
    assert keyed.post("/", headers=BROWSER, json={"inputs": "Hi"}).status_code == 401
    assert keyed.post("/v1/chat/completions", headers=BROWSER, json={}).status_code == 401
    assert client(api_key=KEY, playground=False).get("/", headers=BROWSER).status_code == 401


def test_the_flag_and_its_environment_variable():
    assert parse_args([], {}).disable_playground is False
    assert parse_args(["--disable-playground"], {}).disable_playground is True
    assert parse_args([], {"DISABLE_PLAYGROUND": "1"}).disable_playground is True


# -- a real server (tiny model) ------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("playground")
    path = save_tiny_served_model(tmp / "tiny")
    with RunningServer(tmp / "s", str(path), max_total_tokens=256, max_input_tokens=200) as s:
        yield s.url


def counter(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_post_root_still_generates_and_page_loads_are_no_requests(server):
    received = counter(server, "tgi_request_count")
    assert httpx.get(server + "/", headers=BROWSER).status_code == 200
    assert all(httpx.get(server + path).status_code == 200 for path in ASSETS)
    assert counter(server, "tgi_request_count") == received
    r = httpx.post(server + "/", headers=BROWSER, json={"inputs": "Hi", "parameters": {"max_new_tokens": 3}})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert list(r.json()[0]) == ["generated_text"]
    assert counter(server, "tgi_request_count") == received + 1
