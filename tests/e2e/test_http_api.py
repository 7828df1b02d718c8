"""TGI's HTTP API end to end over loopback: the real launcher process (its
router and shard) serving a tiny random llama with a byte-level tokenizer."""

import asyncio
import json
import signal

import httpx
import pytest

from ..shard_harness import save_tiny_served_model
from .router_harness import launch


class Server:
    def __init__(self, url: str):
        self.url = url


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("http")
    path = save_tiny_served_model(tmp / "tiny")
    proc, url = launch(str(path), tmp, "--max-total-tokens", "256", "--max-input-tokens", "200")
    yield Server(url)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def post(server, route, body, **kw):
    return httpx.post(server.url + route, json=body, timeout=60, **kw)


def sse_events(server, route, body) -> list[dict]:
    with httpx.stream("POST", server.url + route, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]


GREEDY = {"max_new_tokens": 12, "do_sample": False}


def test_generate_returns_text_details_and_headers(server):
    r = post(server, "/generate", {"inputs": "Hello", "parameters": {**GREEDY, "details": True}})
    assert r.status_code == 200
    body = r.json()
    assert isinstance(body["generated_text"], str)
    d = body["details"]
    assert d["finish_reason"] in ("length", "eos_token") and d["generated_tokens"] == len(d["tokens"])
    assert d["seed"] is None and d["prefill"] == []
    assert r.headers["x-prompt-tokens"] == "6" and r.headers["x-generated-tokens"] == str(d["generated_tokens"])
    for h in ("x-compute-type", "x-total-time", "x-validation-time", "x-queue-time", "x-inference-time",
              "x-time-per-token"):
        assert h in r.headers


def test_stream_tokens_concatenate_to_generated_text(server):
    events = sse_events(server, "/generate_stream", {"inputs": "Hello", "parameters": {**GREEDY, "details": True}})
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert all(e["generated_text"] is None for e in events[:-1])
    final = events[-1]
    assert final["details"]["generated_tokens"] == len(events)
    plain = post(server, "/generate", {"inputs": "Hello", "parameters": GREEDY}).json()["generated_text"]
    assert final["generated_text"] == plain
    # special tokens' text (</s>) is streamed, as TGI does, but not in generated_text
    assert "".join(e["token"]["text"] for e in events).replace("</s>", "") == plain


def test_stream_flag_on_generate_and_compat_route(server):
    assert sse_events(server, "/generate", {"inputs": "Hi", "parameters": GREEDY, "stream": True})
    r = post(server, "/", {"inputs": "Hi", "parameters": GREEDY})
    assert r.status_code == 200 and isinstance(r.json(), list) and len(r.json()) == 1
    assert sse_events(server, "/", {"inputs": "Hi", "parameters": GREEDY, "stream": True})


def test_decoder_input_details_and_top_n_tokens(server):
    r = post(server, "/generate", {"inputs": "abc", "parameters": {
        **GREEDY, "details": True, "decoder_input_details": True, "top_n_tokens": 3}})
    d = r.json()["details"]
    assert [t["id"] for t in d["prefill"]][0] == 256 and d["prefill"][0]["logprob"] is None
    assert len(d["prefill"]) == 4 and all(t["logprob"] <= 0 for t in d["prefill"][1:])
    assert all(len(top) == 3 for top in d["top_tokens"])
    assert d["top_tokens"][0][0]["id"] == d["tokens"][0]["id"]


def test_seeded_sampling_is_reproducible_and_reports_the_seed(server):
    params = {"max_new_tokens": 10, "do_sample": True, "temperature": 0.8, "seed": 42, "details": True}
    a = post(server, "/generate", {"inputs": "x", "parameters": params}).json()
    b = post(server, "/generate", {"inputs": "x", "parameters": params}).json()
    assert a == b and a["details"]["seed"] == 42


def test_stop_sequence_finishes_with_stop_sequence(server):
    text = post(server, "/generate", {"inputs": "Hello", "parameters": GREEDY}).json()["generated_text"]
    stop = text[3:5]
    d = post(server, "/generate", {"inputs": "Hello", "parameters": {**GREEDY, "stop": [stop], "details": True}})
    body = d.json()
    assert body["details"]["finish_reason"] == "stop_sequence" and body["generated_text"].endswith(stop)


def test_best_of_returns_the_other_sequences(server):
    r = post(server, "/generate", {"inputs": "Hello", "parameters": {
        "max_new_tokens": 6, "do_sample": True, "best_of": 2, "details": True}})
    assert r.status_code == 200 and len(r.json()["details"]["best_of_sequences"]) == 1


@pytest.mark.parametrize("params, message", [
    ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ({"temperature": 0}, "`temperature` must be strictly positive"),
    ({"repetition_penalty": 0}, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 3}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"top_p": 1.5}, "`top_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 0}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
    ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"truncate": 0}, "`truncate` must be strictly positive and less than 200. Given: 0"),
    ({"max_new_tokens": 300}, "`inputs` tokens + `max_new_tokens` must be <= 256"),
])
def test_validation_errors_are_422(server, params, message):
    r = post(server, "/generate", {"inputs": "Hello", "parameters": params})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert message in r.json()["error"]


def test_too_long_inputs_and_empty_inputs_are_422(server):
    r = post(server, "/generate", {"inputs": "x" * 230, "parameters": {"max_new_tokens": 1}})
    assert r.status_code == 422 and "`inputs` must have less than 200 tokens. Given: 231" in r.json()["error"]
    r = post(server, "/generate", {"inputs": "", "parameters": {}})
    assert r.status_code == 422 and "`inputs` cannot be empty" in r.json()["error"]
    r = post(server, "/generate_stream", {"inputs": "x", "parameters": {"best_of": 2, "do_sample": True}})
    assert r.status_code == 422 and "`best_of` != 1 is not supported when streaming tokens" in r.json()["error"]


def test_bad_bodies_are_4xx_not_500(server):
    assert post(server, "/generate", {"parameters": {}}).status_code == 422
    r = httpx.post(server.url + "/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500


@pytest.mark.parametrize("headers", [{}, {"content-type": "text/plain"},
                                     {"content-type": "application/x-www-form-urlencoded"}])
def test_a_body_not_sent_as_json_is_415_as_tgi_answers(server, headers):
    for route in ("/generate", "/v1/chat/completions"):
        r = httpx.post(server.url + route, content=b'{"inputs": "x"}', headers=headers, timeout=60)
        assert r.status_code == 415
        assert r.json() == {"error": "Expected request with `Content-Type: application/json`",
                            "error_type": "content_type"}


def test_payload_limit_is_413(server):
    r = post(server, "/generate", {"inputs": "a" * 2_100_000})
    assert r.status_code == 413 and r.json()["error_type"] == "payload_too_large"


def test_info_health_metrics_tokenize(server):
    info = httpx.get(server.url + "/info").json()
    assert info["max_total_tokens"] == 256 and info["max_input_tokens"] == 200
    assert httpx.get(server.url + "/health").status_code == 200
    metrics = httpx.get(server.url + "/metrics").text
    assert "tgi_request_success" in metrics and "tgi_kv_cache_blocks_free" in metrics
    tokens = post(server, "/tokenize", {"inputs": "hé"}).json()
    assert [t["id"] for t in tokens][0] == 256 and tokens[-1]["stop"] == 2
    spec = httpx.get(server.url + "/api-doc/openapi.json").json()
    assert {"/generate", "/generate_stream", "/", "/health", "/info", "/metrics", "/tokenize"} <= set(spec["paths"])
    assert httpx.get(server.url + "/docs").status_code == 200


def metric(server, name: str) -> float:
    lines = [line for line in httpx.get(server.url + "/metrics").text.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[1])


def test_disconnected_stream_returns_its_blocks(server):
    total = metric(server, "tgi_kv_cache_blocks_capacity")

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            async with c.stream("POST", server.url + "/generate_stream",
                                json={"inputs": "Hello", "parameters": {"max_new_tokens": 200}}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        break  # hang up after the first token
    asyncio.run(go())
    for _ in range(50):
        if metric(server, "tgi_kv_cache_blocks_free") == total:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert metric(server, "tgi_kv_cache_blocks_free") == total


def test_64_concurrent_greedy_requests_match_alone(server):
    prompts = [f"prompt number {i}" for i in range(64)]
    alone = [post(server, "/generate", {"inputs": q, "parameters": GREEDY}).json()["generated_text"]
             for q in prompts]

    async def together():
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(*(c.post(server.url + "/generate", json={"inputs": q, "parameters": GREEDY})
                                        for q in prompts))
            return [r.json()["generated_text"] for r in rs]
    assert asyncio.run(together()) == alone
