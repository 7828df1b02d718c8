"""Structured output within max_new_tokens, over HTTP with the default model.

The real launcher (SmolLM2, 2 threads, the shard's own dtype) gets 50 JSON
Schema requests on /generate (unbounded integers, numbers, strings, arrays
with and without maxItems, nested objects, enums), 20 regex requests and 20
tool calls on /v1/chat/completions under tool_choice "required", each with a
budget between the grammar's shortest output and three times it, half
greedy and half seeded sampling. Each answer must parse and validate
(`jsonschema` against the client's schema, `re.fullmatch`); a complete
answer must not report `length`. The shortest output is what the server's
422 names when asked for a single token, which this also checks."""

import asyncio
import collections
import json
import re
import tempfile

import httpx
import jsonschema

from .http import gather_limited, launched
from .machine import dtype_name, serving_dtype

FACTORS = (1.0, 1.5, 2.0, 2.5, 3.0)
CONCURRENCY = 16
_MINIMUM = re.compile(r"must be at least (\d+) for this grammar")

SCHEMAS = [
    {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                                      "count": {"type": "integer"}, "bright": {"type": "boolean"}},
     "required": ["color", "count", "bright"]},
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                      "height": {"type": "number"}}, "required": ["name", "age", "height"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
     "required": ["tags"]},
    {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
     "required": ["scores"]},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "first": {"type": "string"}, "last": {"type": "string"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
                    "required": ["city", "zip"]}}, "required": ["first", "last", "address"]}},
     "required": ["person"]},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"},
                                         "price": {"type": "number"}}, "required": ["sku", "qty", "price"]}}},
     "required": ["items"]},
    {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                      "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror"]},
                                                 "maxItems": 2}, "rating": {"type": "number"}},
     "required": ["title", "year", "genres", "rating"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {
        "type": "array", "items": {"type": "number"}}}}, "required": ["matrix"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "code": {"type": "integer"},
                                      "message": {"type": "string"}, "details": {"type": "object", "properties": {
                                          "field": {"type": "string"}, "reason": {"type": "string"}},
                                          "required": ["field"]}}, "required": ["ok", "code", "message"]},
    {"type": "object", "properties": {"planet": {"type": "string"}, "moons": {"type": "integer"},
                                      "mass_kg": {"type": "number"},
                                      "atmosphere": {"type": "array", "items": {"type": "string"}}},
     "required": ["planet", "moons", "mass_kg", "atmosphere"]},
]
JSON_PROMPTS = ["Describe a color as JSON:", "Describe a person as JSON:", "List some tags as JSON:",
                "Give three scores as JSON:", "Describe a person and their address as JSON:",
                "Write an order with items as JSON:", "Describe a movie as JSON:", "Write a matrix as JSON:",
                "Describe an API error as JSON:", "Describe a planet as JSON:"]
REGEXES = [(r"[a-z]+@[a-z]+\.(com|org)", "An email address:"),
           (r"\d{3}-\d{3}-\d{4}", "A phone number:"),
           (r"(yes|no), because [a-z ]+\.", "Is the sky blue? Answer:"),
           (r"[A-Z][a-z]{2,9}( [A-Z][a-z]{2,9}){0,2}", "A city name:"),
           (r"\d+(\.\d{1,2})? (USD|EUR)", "A price:")]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"},
                                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "integer"}, "b": {"type": "integer"}},
                                          "required": ["a", "b"]}}},
]
TOOL_PROMPTS = ["What is the weather in Paris?", "What is 2 plus 3?", "Is it cold in Oslo today?",
                "Add 40 and 2.", "Weather in Tokyo in fahrenheit?"]


def _sampling(i: int) -> dict:
    return {"do_sample": False} if i % 2 == 0 else {"do_sample": True, "temperature": 1.0, "seed": 1000 + i}


async def _minimum(client: httpx.AsyncClient, url: str, route: str, body: dict) -> int:
    r = await client.post(url + route, json=body)
    assert r.status_code == 422, (r.status_code, r.text)
    return int(_MINIMUM.search(r.json()["error"]).group(1))


async def _generate(client, url, prompt, grammar, max_new, i) -> dict:
    body = {"inputs": prompt, "parameters": dict(max_new_tokens=max_new, details=True, grammar=grammar,
                                                 **_sampling(i))}
    r = await client.post(url + "/generate", json=body)
    return {"status": r.status_code, **(r.json() if r.status_code == 200 else {"error": r.text})}


async def _json_cases(client, url) -> list[dict]:
    cases = []
    for schema, prompt in zip(SCHEMAS, JSON_PROMPTS):
        grammar = {"type": "json", "value": schema}
        minimum = await _minimum(client, url, "/generate", {"inputs": prompt, "parameters": {
            "max_new_tokens": 1, "grammar": grammar}})
        for j, factor in enumerate(FACTORS):
            cases.append({"kind": "json", "schema": schema, "prompt": prompt, "grammar": grammar,
                          "minimum": minimum, "max_new": max(minimum, round(minimum * factor)), "i": j})
    return cases


async def _regex_cases(client, url) -> list[dict]:
    cases = []
    for pattern, prompt in REGEXES:
        grammar = {"type": "regex", "value": pattern}
        minimum = await _minimum(client, url, "/generate", {"inputs": prompt, "parameters": {
            "max_new_tokens": 1, "grammar": grammar}})
        for j, factor in enumerate((1.0, 1.5, 2.0, 3.0)):
            cases.append({"kind": "regex", "pattern": pattern, "prompt": prompt, "grammar": grammar,
                          "minimum": minimum, "max_new": max(minimum, round(minimum * factor)), "i": j})
    return cases


def _chat_body(prompt: str, max_tokens: int, i: int) -> dict:
    body = {"model": "tgi", "messages": [{"role": "user", "content": prompt}], "tools": TOOLS,
            "tool_choice": "required", "max_tokens": max_tokens}
    s = _sampling(i)
    body.update({"temperature": 0.0} if not s["do_sample"] else {"temperature": 1.0, "seed": s["seed"]})
    return body


async def _tool_cases(client, url) -> list[dict]:
    minimum = await _minimum(client, url, "/v1/chat/completions", _chat_body(TOOL_PROMPTS[0], 1, 0))
    cases = []
    for k in range(20):
        factor = FACTORS[k % len(FACTORS)] if k < 15 else 1.0 + (k - 15) * 0.5
        cases.append({"kind": "tool", "prompt": TOOL_PROMPTS[k % len(TOOL_PROMPTS)], "minimum": minimum,
                      "max_new": max(minimum, round(minimum * factor)), "i": k})
    return cases


async def _run_case(client, url, case: dict) -> dict:
    if case["kind"] == "tool":
        r = await client.post(url + "/v1/chat/completions", json=_chat_body(case["prompt"], case["max_new"], case["i"]))
        if r.status_code != 200:
            return dict(case, ok=False, why=f"HTTP {r.status_code}: {r.text[:200]}")
        choice = r.json()["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        if len(calls) != 1:
            return dict(case, ok=False, why=f"no tool call: {choice}", finish=choice["finish_reason"])
        fn = calls[0]["function"]
        params = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == fn["name"])
        try:
            jsonschema.validate(json.loads(fn["arguments"]), params)
        except (json.JSONDecodeError, jsonschema.ValidationError) as err:
            return dict(case, ok=False, why=str(err)[:200], text=fn["arguments"])
        ok = choice["finish_reason"] in ("stop", "tool_calls")
        return dict(case, ok=ok, text=fn["name"] + fn["arguments"], finish=choice["finish_reason"],
                    why="" if ok else "a complete call reported " + choice["finish_reason"])
    out = await _generate(client, url, case["prompt"], case["grammar"], case["max_new"], case["i"])
    if out["status"] != 200:
        return dict(case, ok=False, why=f"HTTP {out['status']}: {out['error'][:200]}")
    text, details = out["generated_text"], out["details"]
    finish, tokens = details["finish_reason"], details["generated_tokens"]
    try:
        if case["kind"] == "json":
            jsonschema.validate(json.loads(text), case["schema"])
        elif not re.fullmatch(case["pattern"], text):
            raise ValueError("no full match")
    except (json.JSONDecodeError, jsonschema.ValidationError, ValueError) as err:
        return dict(case, ok=False, why=str(err)[:200], text=text, finish=finish, tokens=tokens)
    ok = finish != "length"
    return dict(case, ok=ok, text=text, finish=finish, tokens=tokens,
                why="" if ok else "a complete answer reported length")


async def drive(url: str) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        cases = await _json_cases(client, url) + await _regex_cases(client, url) + await _tool_cases(client, url)
        results, seconds = await gather_limited(lambda case: _run_case(client, url, case), cases, CONCURRENCY)
        below = await client.post(url + "/generate", json={"inputs": JSON_PROMPTS[0], "parameters": {
            "max_new_tokens": cases[0]["minimum"] - 1, "grammar": cases[0]["grammar"]}})
    return {"results": results, "seconds": seconds, "below": below}


def run() -> dict:
    with tempfile.TemporaryDirectory() as tmp, launched(tmp) as (url, _):
        out = asyncio.run(drive(url))
    results = out["results"]
    print(f"Structured output within max_new_tokens: SmolLM2 over HTTP, {dtype_name(serving_dtype())}, "
          f"{len(results)} requests in {out['seconds']:.1f} s")
    summary = {}
    for kind in ("json", "regex", "tool"):
        mine = [r for r in results if r["kind"] == kind]
        good = sum(r["ok"] for r in mine)
        summary[f"structured_{kind}_valid"] = f"{good}/{len(mine)}"
        finishes = dict(collections.Counter(r.get("finish") for r in mine))
        at_budget = sum(r.get("tokens") == r["max_new"] for r in mine)
        print(f"  {kind:<6} {good}/{len(mine)} valid; finish reasons {finishes}"
              + (f"; {at_budget} used their whole budget" if kind != "tool" else ""))
        for r in mine:
            if not r["ok"]:
                print(f"    FAILED ({r['minimum']}..{r['max_new']} tokens, i={r['i']}): {r['why']} "
                      f"text={r.get('text', '')!r}")
    below = out["below"]
    minimum = results[0]["minimum"]
    refused = below.status_code == 422 and str(minimum) in below.json().get("error", "")
    print(f"  max_new_tokens {minimum - 1} below the minimum {minimum}: HTTP {below.status_code} "
          f"{below.json().get('error', '')!r}")
    summary["structured_below_minimum_is_422"] = refused
    summary["structured_all_valid"] = all(r["ok"] for r in results) and refused
    return summary
