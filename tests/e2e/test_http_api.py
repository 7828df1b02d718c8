"""TGI's HTTP API end to end over loopback, on a tiny random llama with a
byte-level tokenizer, against the real router and a real shard."""

import asyncio
import json

import httpx
import pytest

from ..shard_harness import save_tiny_served_model
from .router_harness import RunningServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("http")
    path = save_tiny_served_model(tmp / "tiny")
    with RunningServer(tmp, str(path), max_concurrent_requests=128, max_total_tokens=256,
                       max_input_tokens=200) as s:
        yield s


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
    ({"temperature": 0}, "`temperature` must be strictly positive"),
    ({"top_p": 1.5}, "`top_p` must be > 0.0 and < 1.0"),
    ({"max_new_tokens": 300}, "must be <= 256"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences"),
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
])
def test_validation_errors_are_422(server, params, message):
    r = post(server, "/generate", {"inputs": "Hello", "parameters": params})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert message in r.json()["error"]


def test_bad_bodies_are_4xx_not_500(server):
    assert post(server, "/generate", {"parameters": {}}).status_code == 422
    r = httpx.post(server.url + "/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500


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
    assert httpx.get(server.url + "/openapi.json").json()["paths"]["/generate"]


def test_disconnected_stream_returns_its_blocks(server):
    free_before = server.shard.runner.cache.num_blocks

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            async with c.stream("POST", server.url + "/generate_stream",
                                json={"inputs": "Hello", "parameters": {"max_new_tokens": 200}}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        break  # hang up after the first token
    asyncio.run(go())
    for _ in range(50):
        text = httpx.get(server.url + "/metrics").text
        free = [line for line in text.splitlines() if line.startswith("tgi_kv_cache_blocks_free ")]
        if free and float(free[0].split()[1]) == free_before:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert float(free[0].split()[1]) == free_before


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
