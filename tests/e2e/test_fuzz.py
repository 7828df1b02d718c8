"""Hostile input: schemathesis against the server's own OpenAPI spec on every
route, and hand-made bodies no schema generator writes. Every answer is a
2xx or a 4xx with TGI's {error, error_type} shape, never a 5xx, and comes
back within a bound."""

import json
import signal
import time

import httpx
import pytest

from ..shard_harness import save_tiny_served_model
from .router_harness import launch

# Per route and generation mode (valid bodies; invalid ones too where a body exists).
FUZZ_EXAMPLES = 4
ANSWER_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The launcher as a process: hypothesis's generation would otherwise
    share the GIL with an in-process router and slow both down."""
    tmp = tmp_path_factory.mktemp("fuzz")
    path = save_tiny_served_model(tmp / "tiny")
    # Short limits keep valid fuzzed generations short.
    proc, url = launch(str(path), tmp, "--max-total-tokens", "64", "--max-input-tokens", "48")
    yield url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def assert_tgi_answer(r: httpx.Response, what: str) -> None:
    assert r.status_code < 500, f"{what}: {r.status_code} {r.text[:300]}"
    if r.status_code >= 400:
        body = r.json()
        assert set(body) == {"error", "error_type"}, f"{what}: {r.text[:300]}"
        assert isinstance(body["error"], str) and isinstance(body["error_type"], str)


def test_schemathesis_finds_no_5xx_and_every_rejection_has_tgis_shape(server):
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(server + "/api-doc/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/", "/generate", "/generate_stream", "/tokenize", "/chat_tokenize",
                                              "/v1/chat/completions", "/v1/completions", "/health", "/info",
                                              "/metrics", "/v1/models"}
    problems, calls = [], 0
    for op in operations:
        # A GET without parameters has no invalid form (hypothesis would search in vain).
        modes = [schemathesis.GenerationMode.POSITIVE] + (
            [schemathesis.GenerationMode.NEGATIVE] if op.method.upper() == "POST" else [])
        for mode in modes:
            @given(case=op.as_strategy(mode))
            @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            def call(case):
                nonlocal calls
                calls += 1
                start = time.monotonic()
                r = case.call(base_url=server, timeout=60)
                if r.status_code >= 500 or time.monotonic() - start > 30:
                    problems.append((case.operation.label, r.status_code, r.text[:200]))
                elif r.status_code >= 400 and set(r.json()) != {"error", "error_type"}:
                    problems.append((case.operation.label, r.status_code, r.text[:200]))
            call()
    assert calls >= len(operations) * FUZZ_EXAMPLES and not problems, problems


def nested(depth: int) -> bytes:
    return b'{"inputs": "x", "parameters": {"stop": ' + b"[" * depth + b"]" * depth + b"}}"


def grammar_body(grammar: dict) -> bytes:
    return json.dumps({"inputs": "x", "parameters": {"max_new_tokens": 2, "grammar": grammar}}).encode()


def json_body(body: dict) -> bytes:
    return json.dumps(body).encode()


HUGE_TEXT = "a " * 950_000  # 1.9 MB: under the payload limit, far over max_input_tokens
HOSTILE = [
    ("invalid UTF-8", "/generate", b'{"inputs": "\xff\xfe abc", "parameters": {"max_new_tokens": 2}}', 400),
    ("invalid UTF-8 in a chat", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\xc3\x28"}], "max_tokens": 2}', 400),
    ("a raw NUL byte", "/generate", b'{"inputs": "a\x00b"}', 400),
    ("a lone surrogate", "/generate", b'{"inputs": "\\ud800", "parameters": {"max_new_tokens": 2}}', 422),
    ("a lone surrogate to /tokenize", "/tokenize", b'{"inputs": "\\ud800x"}', 422),
    ("a lone surrogate in a chat", "/chat_tokenize", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 422),
    ("a 10 MB body", "/generate", b'{"inputs": "' + b"a" * 10_000_000 + b'"}', 413),
    ("1.9 MB of input", "/generate", json_body({"inputs": HUGE_TEXT, "parameters": {"max_new_tokens": 2}}), 422),
    ("1.9 MB to /tokenize", "/tokenize", json_body({"inputs": HUGE_TEXT}), 422),
    ("1.9 MB in a chat", "/v1/chat/completions",
     json_body({"messages": [{"role": "user", "content": HUGE_TEXT}], "max_tokens": 2}), 422),
    ("1.9 MB to /chat_tokenize", "/chat_tokenize", json_body({"messages": [{"role": "user", "content": HUGE_TEXT}]}),
     422),
    ("1.9 MB prompt to /v1/completions", "/v1/completions", json_body({"prompt": HUGE_TEXT, "max_tokens": 2}), 422),
    ("100,000 prompts in one completion", "/v1/completions", json_body({"prompt": ["a"] * 100_000, "max_tokens": 1}),
     422),
    ("JSON nested 100,000 deep", "/generate", nested(100_000), 400),
    ("a JSON array nested 500,000 deep", "/generate", b"[" * 500_000 + b"]" * 500_000, 400),
    ("an object nested 50,000 deep", "/v1/chat/completions",
     b'{"messages": [], "tools": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}", 400),
    ("max_new_tokens past u32", "/generate", b'{"inputs": "x", "parameters": {"max_new_tokens": 99999999999999999999}}',
     422),
    ("max_new_tokens u32::MAX", "/generate", b'{"inputs": "x", "parameters": {"max_new_tokens": 4294967295}}', 422),
    ("max_tokens past u32", "/v1/completions", b'{"prompt": "x", "max_tokens": 99999999999999999999}', 422),
    ("negative max_new_tokens", "/generate", b'{"inputs": "x", "parameters": {"max_new_tokens": -5}}', 422),
    ("negative max_tokens and n", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1, "n": -1}', 422),
    ("negative temperature", "/generate", b'{"inputs": "x", "parameters": {"temperature": -1}}', 422),
    ("NaN", "/generate", b'{"inputs": "x", "parameters": {"temperature": NaN}}', 422),
    ("Infinity", "/generate", b'{"inputs": "x", "parameters": {"top_p": Infinity}}', 422),
    ("1e400", "/generate", b'{"inputs": "x", "parameters": {"temperature": 1e400}}', 422),
    ("NaN in a chat", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 422),
    ("an unclosed regex", "/generate", grammar_body({"type": "regex", "value": "(((("}), 422),
    ("a backreference", "/generate", grammar_body({"type": "regex", "value": "(a)\\1"}), 422),
    ("a look-around", "/generate", grammar_body({"type": "regex", "value": "(?=a)a"}), 422),
    ("a self-referencing schema", "/generate",
     grammar_body({"type": "json", "value": {"properties": {"a": {"$ref": "#"}}, "$ref": "#"}}), 422),
    ("a schema nested 400 deep", "/generate",
     b'{"inputs": "x", "parameters": {"max_new_tokens": 2, "grammar": {"type": "json", "value": '
     + b'{"properties": {"a": ' * 400 + b"{}" + b"}}" * 400 + b"}}}", 422),
    ("a dangling $ref", "/generate",
     grammar_body({"type": "json", "value": {"properties": {"a": {"$ref": "#/nope"}}}}), 422),
    ("not JSON", "/generate", b"{not json", 400),
    ("no such route", "/nope", b"{}", 404),
]


@pytest.mark.parametrize("what, route, body, status", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_body_is_a_4xx_in_bounded_time(server, what, route, body, status):
    start = time.monotonic()
    r = httpx.post(server + route, content=body, headers={"content-type": "application/json"}, timeout=60)
    elapsed = time.monotonic() - start
    assert r.status_code == status, f"{what}: {r.status_code} {r.text[:300]}"
    assert_tgi_answer(r, what)
    assert elapsed < ANSWER_WITHIN_S, f"{what} took {elapsed:.1f} s"


EXPLOSIVE = [
    ("catastrophic backtracking", {"type": "regex", "value": "(a+)+$"}),
    ("a DFA that explodes", {"type": "regex", "value": "(a|b)*a(a|b){40}"}),
    ("nested counted repeats", {"type": "regex", "value": "(((a|b){100}){100}){100}"}),
    ("huge counts", {"type": "regex", "value": "[a-z]{1,65535}[0-9]{1,65535}"}),
    ("1,000 properties with patterns", {"type": "json", "value": {
        "properties": {f"p{i}": {"type": "string", "pattern": "(a|b)*a(a|b){20}"} for i in range(1000)}}}),
    ("a billion items", {"type": "json", "value": {
        "properties": {"a": {"type": "array", "minItems": 1_000_000_000}}, "required": ["a"]}}),
]


@pytest.mark.parametrize("what, grammar", EXPLOSIVE, ids=[e[0] for e in EXPLOSIVE])
def test_explosive_grammar_is_answered_in_bounded_time(server, what, grammar):
    """Grammars that blow up backtracking or automaton engines: llguidance
    compiles them lazily, so they are served (or refused) quickly."""
    start = time.monotonic()
    r = httpx.post(server + "/generate", content=grammar_body(grammar),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code in (200, 422)
    assert_tgi_answer(r, what)
    assert time.monotonic() - start < 2 * ANSWER_WITHIN_S


def test_server_still_serves_after_the_abuse(server):
    r = httpx.post(server + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}},
                   timeout=60)
    assert r.status_code == 200
    assert httpx.get(server + "/health").status_code == 200
