"""--speculate over HTTP: a server that drafts answers exactly what one that
does not answers (text, token ids, logprobs' tokens, finish reasons), for
prompts that repeat themselves and prompts that never do, stop sequences
that fall inside accepted runs, and JSON-schema constrained requests;
several tokens of one step stream as separate events; the speculation
metrics count the drafts and every KV block comes back."""

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ..shard_harness import InProcessShard, save_tiny_served_model, torch_threads
from .router_harness import RunningServer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer"}}, "required": ["name", "n"]}


def tiny_requests() -> list[dict]:
    """32 /generate bodies for the byte-level tiny model."""
    rng = random.Random(5)
    repeating = ["abcabcabcabcabc", "the cat sat on the mat. the cat sat on the mat. the cat",
                 "1 2 3 4 1 2 3 4 1 2 3 4 1 2", "xyxyxyxyxyxyxyxy", "hello hello hello hello",
                 "<a><b></b></a><a><b></b></a><a>", "0101010101010101", "do re mi do re mi do re"]
    plain = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.") for _ in range(rng.randrange(3, 40)))
             for _ in range(16)]
    bodies = [{"inputs": text, "parameters": {"max_new_tokens": 40, "do_sample": False, "details": True}}
              for text in repeating + plain]
    for i in range(4):  # sampled with seeds: the same draws with drafts
        bodies.append({"inputs": repeating[i], "parameters": {
            "max_new_tokens": 30, "do_sample": True, "seed": 40 + i, "temperature": 0.5, "top_k": 20,
            "repetition_penalty": 1.1, "details": True}})
    for i in range(4):  # JSON schema
        bodies.append({"inputs": f"record {i}: ", "parameters": {
            "max_new_tokens": 40, "details": True, "grammar": {"type": "json", "value": SCHEMA}}})
    return bodies


def answers(url: str, bodies: list[dict]) -> list[dict]:
    def one(body):
        r = httpx.post(url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        d = out["details"]
        return {"text": out["generated_text"], "ids": [t["id"] for t in d["tokens"]],
                "finish": d["finish_reason"]}
    with ThreadPoolExecutor(8) as pool:  # batched, as a loaded server runs them
        return list(pool.map(one, bodies))


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def with_stops(bodies: list[dict], baseline: list[dict]) -> list[dict]:
    """The bodies again, each greedy one that generated text stopping at 3
    characters from the middle of what it generated."""
    out = []
    for body, answer in zip(bodies, baseline):
        text = answer["text"]
        if body["parameters"].get("do_sample") or "grammar" in body["parameters"] or len(text) < 10:
            continue
        stop = text[len(text) // 2:len(text) // 2 + 3]
        out.append({**body, "parameters": {**body["parameters"], "stop": [stop]}})
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec_http")
    return save_tiny_served_model(tmp / "tiny", seed=4), tmp


@pytest.fixture(scope="module")
def baseline(tiny):
    """(bodies, answers, bodies with stops, their answers) of the tiny model
    without speculation: one server's, which every drafting server here
    (n-gram, draft model, Medusa heads) must give."""
    path, tmp = tiny
    bodies = tiny_requests()
    with torch_threads(1), RunningServer(tmp / "s0", str(path), max_total_tokens=256,
                                         max_input_tokens=200) as server:
        answered = answers(server.url, bodies)
        stops = with_stops(bodies, answered)
        return bodies, answered, stops, answers(server.url, stops)


def test_answers_equal_those_without_speculation(tiny, baseline):
    path, tmp = tiny
    bodies, baseline, stops, stopped = baseline
    assert len(stops) >= 16 and sum(a["finish"] == "stop_sequence" for a in stopped) >= 10
    assert all({"name", "n"} <= json.loads(a["text"]).keys() for a in baseline[-4:])
    for speculate in (1, 3, 6):
        with torch_threads(1), RunningServer(tmp / f"s{speculate}", str(path), max_total_tokens=256,
                                             max_input_tokens=200, speculate=speculate) as server:
            assert answers(server.url, bodies) == baseline, speculate
            assert answers(server.url, stops) == stopped, speculate
            assert metric(server.url, "tgi_speculative_draft_tokens") > 0
            assert metric(server.url, "tgi_speculative_accepted_tokens") > 0
            assert metric(server.url, "tgi_kv_cache_blocks_used") == 0


COPY = ("The old lighthouse stood at the edge of the cliff for more than two hundred years. Every night its keeper "
        "climbed the narrow stairs, trimmed the wick and polished the great lens until it shone.")


def chat(url: str, content: str, **params) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": content}], "max_tokens": 50, "temperature": 0, **params},
        timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def stream_events(url: str, content: str) -> list[dict]:
    body = {"inputs": content, "parameters": {"max_new_tokens": 40, "details": True}}
    with httpx.stream("POST", url + "/generate_stream", json=body, timeout=120) as r:
        return [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]


def test_the_default_model_copying_text_accepts_runs_and_stops_inside_them(tmp_path):
    """SmolLM2 repeating a paragraph: nearly every draft is accepted, so a
    stop string in the middle of the copy ends an accepted run."""
    prompt = "Copy this text word for word:\n\n" + COPY

    def run(speculate: int):
        # Drafting is the router's: both routers, one after the other, use one loaded shard.
        with RunningServer(tmp_path / f"smol{speculate}", None, shard=shard, speculate=speculate,
                           max_batch_prefill_tokens=128, max_input_tokens=120, max_total_tokens=180) as server:
            plain = chat(server.url, prompt)
            stopped = chat(server.url, prompt, stop=["narrow stairs"])
            events = stream_events(server.url, "Repeat: " + COPY + "\nAgain: " + COPY[:40])
            accepted = metric(server.url, "tgi_speculative_accepted_tokens")
            skipped = metric(server.url, "tgi_request_skipped_tokens_sum")
        return plain, stopped, events, accepted, skipped

    with torch_threads(1), InProcessShard(tmp_path, None, kv_cache_bytes=16 << 20) as shard:
        plain, stopped, events, _, _ = run(0)
        plain4, stopped4, events4, accepted, skipped = run(4)
    assert plain4 == plain and stopped4 == stopped and stopped4["finish_reason"] == "stop"
    assert stopped4["message"]["content"].endswith("narrow stairs")  # nothing kept past the stop
    assert accepted > 40 and skipped == accepted
    # one event per token, in order, the same tokens as without drafts
    assert [e["token"]["id"] for e in events4] == [e["token"]["id"] for e in events]
    assert events4[-1]["generated_text"] == events[-1]["generated_text"]
    assert len(events4) == events4[-1]["details"]["generated_tokens"]


def test_a_draft_model_serves_the_targets_answers_and_its_blocks_come_back(tiny, baseline):
    """--speculative-model: a tiny draft with the target's tokenizer; the
    answers are the target's at --speculate 1, 3 and 6 (stops included), and
    once they are done every KV block (the target's and the draft's share
    ids) is free again."""
    path, tmp = tiny
    draft = save_tiny_served_model(tmp / "draft", seed=9, num_hidden_layers=1)
    bodies, baseline, stops, stopped = baseline
    for speculate in (1, 3, 6):
        with torch_threads(1), RunningServer(tmp / f"d{speculate}", str(path), max_total_tokens=256,
                                             max_input_tokens=200, speculate=speculate,
                                             speculative_model=str(draft)) as server:
            assert server.shard.runner.draft is not None
            assert answers(server.url, bodies) == baseline, speculate
            assert answers(server.url, stops) == stopped, speculate
            assert metric(server.url, "tgi_speculative_draft_tokens") > 0
            assert metric(server.url, "tgi_kv_cache_blocks_used") == 0
            assert metric(server.url, "tgi_kv_cache_blocks_free") == metric(server.url, "tgi_kv_cache_blocks_capacity")


def test_a_model_with_medusa_heads_drafts_with_them_unless_told_otherwise(tiny, baseline):
    """TGI's default: no --speculate and Medusa heads in the model directory
    means as many drafts as heads; --speculate 0 turns them off."""
    import shutil

    from ..server.test_speculation import save_medusa
    path, tmp = tiny
    medusa = save_medusa(shutil.copytree(path, tmp / "medusa"), heads=2, copy_lm_head=True)
    bodies, baseline = baseline[0][:8], baseline[1][:8]
    with torch_threads(1), RunningServer(tmp / "m1", str(medusa), max_total_tokens=256,
                                         max_input_tokens=200) as server:
        assert answers(server.url, bodies) == baseline
        assert metric(server.url, "tgi_speculative_draft_tokens") > 0
        assert metric(server.url, "tgi_kv_cache_blocks_used") == 0
    with torch_threads(1), RunningServer(tmp / "m2", str(medusa), max_total_tokens=256, max_input_tokens=200,
                                         speculate=0) as server:
        assert answers(server.url, bodies) == baseline
        assert metric(server.url, "tgi_speculative_draft_tokens") == 0
