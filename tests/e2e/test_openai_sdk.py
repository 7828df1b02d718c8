"""The `openai` SDK itself, sync and async, streaming and not, against the
real launcher serving a tiny random model: every route, every shape the SDK
parses, tools and response_format under their grammars, and errors.

A random model writes nonsense, so the schemas here keep every value
bounded (enums, booleans, bounded integers): the grammar alone decides
where the output ends. The tokenizer spends a token per byte, hence the
generous max_tokens for JSON."""

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from ..shard_harness import save_tiny_model, save_tiny_tokenizer
from .router_harness import launch

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "set_alarm", "parameters": {"type": "object", "properties": {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23}, "loud": {"type": "boolean"}},
        "required": ["hour", "loud"]}}}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai")
    model = tmp / "tiny"
    save_tiny_model("llama", model, vocab_size=320, bos_token_id=256, eos_token_id=257,
                    max_position_embeddings=2048)
    save_tiny_tokenizer(model)
    # The byte-level tokenizer spends a token per byte of the tools' JSON.
    proc, url = launch(str(model), tmp, "--max-input-tokens", "1800", "--max-total-tokens", "2000")
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(model="tgi", messages=MESSAGES, max_tokens=kw.pop("max_tokens", 12),
                                          **kw)


def test_models_list(client):
    models = client.models.list()
    assert len(models.data) == 1 and models.data[0].object == "model"


def test_chat_completion_shape(client):
    r = chat(client, temperature=0, seed=1)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.system_fingerprint


def test_stream_reassembles_to_the_same_content(client):
    whole = chat(client, temperature=0.8, seed=7, max_tokens=16)
    chunks = list(chat(client, temperature=0.8, seed=7, max_tokens=16, stream=True,
                       stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stream_ends_with_done(server):
    with httpx.stream("POST", server + "/v1/chat/completions", timeout=60, json={
            "messages": MESSAGES, "max_tokens": 3, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_n_choices_are_independent_and_reproducible(client):
    first = chat(client, n=3, seed=11, temperature=1.0, logprobs=True)
    again = chat(client, n=3, seed=11, temperature=1.0)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert len({c.message.content for c in first.choices}) > 1
    assert first.usage.completion_tokens == sum(len(c.logprobs.content) for c in first.choices)


def test_n_choices_stream_interleaved(client):
    chunks = list(chat(client, n=2, seed=5, temperature=1.0, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    whole = chat(client, n=2, seed=5, temperature=1.0)
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]


def test_greedy_is_deterministic(client):
    first, again = chat(client, temperature=0), chat(client, temperature=0)
    assert first.choices[0].message.content == again.choices[0].message.content


def test_logprobs(client):
    r = chat(client, temperature=0, logprobs=True, top_logprobs=3, max_tokens=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-4  # greedy took the best
        assert bytes(entry.bytes).decode() == entry.token


def test_stop_and_length_finish_reasons(client):
    assert chat(client, max_tokens=2, temperature=0).choices[0].finish_reason == "length"


def test_json_schema_response_format(client):
    schema = {"type": "object", "properties": {
        "mood": {"type": "string", "enum": ["happy", "sad"]}, "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["mood", "ok", "n"]}
    for seed in (1, 2, 3):
        r = chat(client, max_tokens=200, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "m", "schema": schema, "strict": True}})
        value = json.loads(r.choices[0].message.content)
        jsonschema.validate(value, schema)
        assert set(value) == {"mood", "ok", "n"}  # strict: nothing else
        assert r.choices[0].finish_reason == "stop"


def test_tool_choice_required_and_named(client):
    for choice in ("required", {"type": "function", "function": {"name": "set_alarm"}}):
        r = chat(client, max_tokens=200, tools=[WEATHER, CLOCK], tool_choice=choice, temperature=0)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        call = r.choices[0].message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        tool = {"get_weather": WEATHER, "set_alarm": CLOCK}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        if isinstance(choice, dict):
            assert call.function.name == "set_alarm"


def test_streamed_tool_call_reassembles(client):
    kw = dict(max_tokens=200, tools=[WEATHER, CLOCK], tool_choice="required", seed=3, temperature=0.9)
    whole = chat(client, **kw).choices[0].message.tool_calls[0]
    name, args, ids = None, "", set()
    for c in chat(client, stream=True, **kw):
        for delta in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            assert delta.index == 0
            ids.add(delta.id) if delta.id else None
            name = delta.function.name or name
            args += delta.function.arguments or ""
    assert name == whole.function.name and args == whole.function.arguments and len(ids) == 1


def test_tool_choice_auto_answers_in_the_right_shape(client):
    for seed in range(4):
        r = chat(client, max_tokens=40, tools=[WEATHER], tool_choice="auto", seed=seed, temperature=1.0)
        message = r.choices[0].message
        if message.tool_calls:
            assert r.choices[0].finish_reason == "tool_calls" and message.content is None
            jsonschema.validate(json.loads(message.tool_calls[0].function.arguments),
                                WEATHER["function"]["parameters"])
        else:
            assert not message.content.startswith("{")


def test_tool_choice_none_is_free_text(client):
    r = chat(client, tools=[WEATHER], tool_choice="none", temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_completions(client):
    r = client.completions.create(model="tgi", prompt=["Hello", "Bye now"], max_tokens=4, n=2, seed=2,
                                  logprobs=2, temperature=1.0)
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        # (a random model writes bytes that are no UTF-8: token texts need not join to the text)
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == 4
        assert c.logprobs.text_offset[0] == 0 and c.logprobs.text_offset == sorted(c.logprobs.text_offset)
        assert all(len(t) <= 2 for t in c.logprobs.top_logprobs)
    assert r.usage.completion_tokens == 16
    echo = client.completions.create(model="tgi", prompt="Hello", max_tokens=3, echo=True, temperature=0)
    assert echo.choices[0].text.startswith("Hello")


def test_completions_stream(client):
    whole = client.completions.create(model="tgi", prompt="Hello", max_tokens=6, seed=4, temperature=0.7)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="tgi", prompt="Hello", max_tokens=6, seed=4, temperature=0.7, stream=True) if c.choices)
    assert text == whole.choices[0].text


def test_errors_are_422_with_tgi_shape(client, server):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        chat(client, n=0)
    assert info.value.response.json()["error_type"] == "validation"
    for body in ({"messages": []}, {"messages": MESSAGES, "temperature": "hot"},
                 {"messages": MESSAGES, "response_format": {"type": "json_schema",
                                                            "json_schema": {"schema": {"type": "strin"}}}},
                 {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": {
                     "type": "function", "function": {"name": "nope"}}},
                 {"messages": MESSAGES, "response_format": {"type": "regex", "value": "(a"}}):
        r = httpx.post(server + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 422 and set(r.json()) == {"error", "error_type"}, (body, r.text)


def test_chat_tokenize(server):
    r = httpx.post(server + "/chat_tokenize", json={"messages": MESSAGES}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["templated_text"] == "system: You are terse.\nuser: Hi there\n"
    assert "".join(t["text"] for t in body["tokenize_response"]) == body["templated_text"]


def test_async_client_concurrent_stream_and_not(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="tgi", messages=MESSAGES, max_tokens=10, seed=9, temperature=0.9)

        async def streamed():
            text = ""
            async for c in await client.chat.completions.create(stream=True, **kw):
                text += c.choices[0].delta.content or "" if c.choices else ""
            return text
        whole, text, *more = await asyncio.gather(client.chat.completions.create(**kw), streamed(),
                                                  *[client.chat.completions.create(**kw) for _ in range(4)])
        await client.close()
        return whole, text, more
    whole, text, more = asyncio.run(main())
    assert text == whole.choices[0].message.content
    assert all(m.choices[0].message.content == text for m in more)


def test_tokenizer_config_path_template_and_its_errors_are_422(tmp_path):
    model = tmp_path / "tiny"
    save_tiny_model("llama", model, vocab_size=320, bos_token_id=256, eos_token_id=257)
    save_tiny_tokenizer(model)
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
        "{% endif %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}{{ ''.__class__.__mro__ }}")}))
    proc, url = launch(str(model), tmp_path, "--tokenizer-config-path", str(config))
    try:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES}, timeout=30)
        assert r.status_code == 422 and r.json() == {"error": "Template error: no system role",
                                                     "error_type": "template_error"}
        # the sandbox refuses the attribute walk: a 422, never a 500
        r = httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES[1:], "max_tokens": 2}, timeout=30)
        assert r.status_code == 422 and r.json()["error_type"] == "template_error"
        r = httpx.post(url + "/chat_tokenize", json={"messages": MESSAGES}, timeout=30)
        assert r.status_code == 422 and r.json()["error_type"] == "template_error"
    finally:
        proc.terminate()
        proc.wait(30)
