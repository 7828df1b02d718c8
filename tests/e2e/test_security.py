"""No way around --api-key on any generation route (TGI's, the compat route,
the OpenAI ones, the tokenizers); /health, /metrics, /info and /v1/models
open as in TGI; CORS only for --cors-allow-origin; a hostile chat template
is sandboxed; a model that ships code does not run it."""

import json

import httpx
import pytest

from ..shard_harness import save_tiny_served_model
from .router_harness import RunningServer

KEY = "s3cret"
AUTH = {"authorization": f"Bearer {KEY}"}
ORIGIN = "https://ok.example"
VALID = {
    "/generate": {"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
    "/generate_stream": {"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
    "/": {"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
    "/tokenize": {"inputs": "Hi"},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/chat_tokenize": {"messages": [{"role": "user", "content": "Hi"}]},
}


@pytest.fixture(scope="module")
def marker(tmp_path_factory):
    return tmp_path_factory.mktemp("marker") / "PWNED"


@pytest.fixture(scope="module")
def server(tmp_path_factory, marker):
    """With a key, one allowed origin, and a chat template that tries to
    reach os.system through Jinja's globals."""
    tmp = tmp_path_factory.mktemp("security")
    path = save_tiny_served_model(tmp / "tiny")
    hostile = tmp / "tokenizer_config.json"
    hostile.write_text(json.dumps({"chat_template": (
        "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}")}))
    with RunningServer(tmp / "s", str(path), max_total_tokens=256, max_input_tokens=200, api_key=KEY,
                       cors_allow_origin=(ORIGIN,), tokenizer_config_path=str(hostile)) as s:
        yield s.url


def generation_routes(url: str) -> list[str]:
    spec = httpx.get(url + "/api-doc/openapi.json").json()
    return sorted(path for path, ops in spec["paths"].items() if "post" in ops)


def test_every_post_route_of_the_spec_is_a_generation_route_we_check(server):
    assert generation_routes(server) == sorted(VALID)


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": KEY},
                                     {"authorization": f"Bearer {KEY}{KEY}"}])
def test_without_the_key_every_generation_route_is_401_even_for_garbage(server, headers):
    for route in generation_routes(server):
        for body in (json.dumps(VALID[route]).encode(), b"{not json", b"\xff" * 100):
            r = httpx.post(server + route, content=body, headers={"content-type": "application/json", **headers})
            assert r.status_code == 401, (route, headers, r.status_code)
            assert r.json()["error_type"] == "unauthorized"


def test_with_the_key_every_generation_route_answers(server):
    for route, body in VALID.items():
        r = httpx.post(server + route, json=body, headers=AUTH, timeout=60)
        if route in ("/v1/chat/completions", "/chat_tokenize"):  # the hostile template: refused, see below
            assert r.status_code == 422, route
        else:
            assert r.status_code == 200, (route, r.text[:200])


def test_health_metrics_info_and_models_are_open(server):
    for route in ("/health", "/metrics", "/info", "/v1/models", "/api-doc/openapi.json"):
        assert httpx.get(server + route).status_code == 200, route


def test_cors_answers_only_the_allowed_origin(server):
    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "authorization"}
    ok = httpx.options(server + "/generate", headers={"origin": ORIGIN, **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    evil = httpx.options(server + "/generate", headers={"origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in evil.headers
    r = httpx.post(server + "/tokenize", json=VALID["/tokenize"], headers={"origin": "https://evil.example", **AUTH})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_a_hostile_chat_template_is_sandboxed(server, marker):
    for route in ("/v1/chat/completions", "/chat_tokenize"):
        r = httpx.post(server + route, json=VALID[route], headers=AUTH, timeout=60)
        assert r.status_code == 422 and r.json()["error_type"] == "template_error"
    assert not marker.exists()


def test_a_model_that_ships_code_is_refused_without_running_it(tmp_path):
    from tgi_server.config import ShardConfig
    from tgi_server.shard import load_shard

    model = tmp_path / "remote"
    model.mkdir()
    marker = tmp_path / "PWNED"
    (model / "config.json").write_text(json.dumps({
        "model_type": "evil", "architectures": ["EvilForCausalLM"], "vocab_size": 16, "hidden_size": 8,
        "auto_map": {"AutoConfig": "modeling_evil.EvilConfig",
                     "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}}))
    (model / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    config = ShardConfig(model_id=str(model), revision=None, uds_path=str(tmp_path / "s"), dtype="float32",
                         device="cpu", block_size=16, kv_cache_bytes=1 << 20, attention_backend=None, num_threads=0)
    with pytest.raises(Exception, match="custom code"):
        load_shard(config)
    assert not marker.exists()
