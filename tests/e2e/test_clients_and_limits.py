"""Real clients unchanged against the server, and the admission limits
(429 over --max-concurrent-requests, 401 without --api-key, CORS) on the
real launcher."""

import asyncio
import signal

import httpx
import pytest

from ..shard_harness import save_tiny_served_model
from .router_harness import RunningServer, launch


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clients")
    return tmp, str(save_tiny_served_model(tmp / "tiny"))


@pytest.fixture(scope="module")
def server(model):
    tmp, path = model
    with RunningServer(tmp / "a", path, max_total_tokens=256, max_input_tokens=200,
                       cors_allow_origin=("https://example.com",)) as s:
        yield s


def test_text_generation_client(server):
    from text_generation import Client

    client = Client(server.url, timeout=60)
    response = client.generate("Hello", max_new_tokens=8, decoder_input_details=True, top_n_tokens=2)
    assert response.details.generated_tokens == len(response.details.tokens) <= 8
    assert response.details.prefill[0].logprob is None
    streamed = list(client.generate_stream("Hello", max_new_tokens=8))
    assert streamed[-1].generated_text == response.generated_text
    assert streamed[-1].details.generated_tokens == len(streamed)


def test_huggingface_hub_inference_client(server, monkeypatch):
    import huggingface_hub.constants
    from huggingface_hub import InferenceClient

    # CI sets HF_HUB_OFFLINE=1 (no downloads), which also stops the client
    # from calling a local server; a user's InferenceClient is online.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    client = InferenceClient(base_url=server.url)
    text = client.text_generation("Hello", max_new_tokens=8)
    assert isinstance(text, str)
    detailed = client.text_generation("Hello", max_new_tokens=8, details=True)
    assert detailed.generated_text == text and detailed.details.generated_tokens >= 1
    chunks = list(client.text_generation("Hello", max_new_tokens=8, stream=True))
    assert "".join(chunks).replace("</s>", "") == text


def test_cors_only_for_the_allowed_origin(server):
    ok = httpx.options(server.url + "/generate", headers={
        "origin": "https://example.com", "access-control-request-method": "POST"})
    assert ok.headers.get("access-control-allow-origin") == "https://example.com"
    other = httpx.options(server.url + "/generate", headers={
        "origin": "https://evil.example", "access-control-request-method": "POST"})
    assert "access-control-allow-origin" not in other.headers


class Launched:
    """The real launcher for the duration of a `with` block."""

    def __init__(self, model: str, tmp, *flags):
        tmp.mkdir(parents=True, exist_ok=True)
        self.proc, self.url = launch(model, tmp, *flags)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(60) == 0


def test_api_key_guards_generation_routes(model):
    tmp, path = model
    with Launched(path, tmp / "b", "--api-key", "s3cret") as s:
        body = {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}
        for route in ("/generate", "/generate_stream", "/"):
            assert httpx.post(s.url + route, json=body).status_code == 401
        assert httpx.post(s.url + "/generate", json=body, headers={"authorization": "Bearer wrong"}).status_code == 401
        assert httpx.post(s.url + "/generate", json=body, headers={"authorization": "Bearer s3cret"},
                          timeout=60).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200


def test_over_max_concurrent_requests_is_429_and_the_rest_finish(model):
    tmp, path = model
    with Launched(path, tmp / "c", "--max-concurrent-requests", "2") as s:
        async def go():
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"inputs": "Hello", "parameters": {"max_new_tokens": 60}}
                return await asyncio.gather(*(c.post(s.url + "/generate", json=body) for _ in range(6)))
        codes = sorted(r.status_code for r in asyncio.run(go()))
        assert codes.count(200) >= 2 and set(codes) <= {200, 429} and 429 in codes
        metrics = httpx.get(s.url + "/metrics").text
        assert 'tgi_request_failure{err="overloaded"}' in metrics


def test_max_client_batch_size_bounds_the_prompts_of_one_completion(model):
    tmp, path = model
    with RunningServer(tmp / "d", path, max_client_batch_size=2) as s:
        assert httpx.get(s.url + "/info").json()["max_client_batch_size"] == 2
        body = {"model": "tgi", "max_tokens": 2}
        ok = httpx.post(s.url + "/v1/completions", json={**body, "prompt": ["a", "b"]}, timeout=60)
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
        refused = httpx.post(s.url + "/v1/completions", json={**body, "prompt": ["a", "b", "c"]}, timeout=60)
        assert refused.status_code == 422
        assert refused.json() == {"error": "Number of prompts exceeds the maximum allowed batch size of 2",
                                  "error_type": "batch size exceeded"}
