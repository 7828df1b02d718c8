"""OpenAI's wire format: what the `openai` SDK sends parses, garbage is a
validation error, and what we write the SDK reads back, both through its
types and through a real client talking to a mock transport."""

import json
import math

import httpx
import openai
import pydantic
import pytest
from openai.types import Completion as SDKCompletion
from openai.types import Model as SDKModel
from openai.types.chat import ChatCompletion as SDKChatCompletion
from openai.types.chat import ChatCompletionChunk as SDKChatCompletionChunk

from tgi_router.openai_compat.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    FunctionCall,
    FunctionCallDelta,
    ImageContentPart,
    Model,
    ModelList,
    NamedToolChoice,
    ResponseFormatJson,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    ResponseFormatRegex,
    ResponseFormatText,
    TextContentPart,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from tgi_router.openai_compat.stream import ChunkFrame

USER = {"role": "user", "content": "hi"}
USAGE = Usage(prompt_tokens=5, completion_tokens=2, total_tokens=7)


class FakeServer:
    """An SDK client whose transport records each request body and answers
    with the next canned JSON body or SSE event list."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.answer: dict | list[pydantic.BaseModel] = {}
        self.client = openai.OpenAI(
            api_key="k", base_url="http://tgi/v1", max_retries=0,
            http_client=httpx.Client(transport=httpx.MockTransport(self._handle)))

    def _handle(self, request: httpx.Request) -> httpx.Response:
        if request.content:
            self.bodies.append(json.loads(request.content))
        if isinstance(self.answer, list):
            events = "".join(f"data: {event.model_dump_json()}\n\n" for event in self.answer)
            return httpx.Response(200, text=events + "data: [DONE]\n\n",
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=self.answer)


@pytest.fixture
def server():
    return FakeServer()


def dump(model: pydantic.BaseModel) -> dict:
    return model.model_dump(mode="json")


# ---------------------------------------------------------------- requests


def test_every_chat_parameter_the_sdk_sends_parses(server):
    server.answer = dump(ChatCompletion(
        id="c", created=1, model="m", usage=USAGE, choices=[ChatChoice(
            index=0, message=AssistantMessage(content="ok"), finish_reason="stop")]))
    server.client.chat.completions.create(
        model="m", messages=[{"role": "developer", "content": "be brief"}, USER],
        frequency_penalty=0.5, presence_penalty=-0.5, logit_bias={"42": -100},
        logprobs=True, top_logprobs=3, max_tokens=10, max_completion_tokens=12, n=1,
        seed=7, stop=["\n", "END"], stream=False, temperature=0.7, top_p=0.9,
        tools=[{"type": "function", "function": {
            "name": "get_weather", "description": "Weather of a city", "strict": True,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        response_format={"type": "json_schema", "json_schema": {
            "name": "w", "schema": {"type": "object"}, "strict": True}},
        user="u", parallel_tool_calls=False, store=True, metadata={"a": "b"},
        extra_body={"tool_prompt": "Use a tool.", "chat_template_kwargs": {"think": False}})
    req = ChatCompletionRequest.model_validate(server.bodies[0])
    assert req.model == "m" and [m.role for m in req.messages] == ["developer", "user"]
    assert (req.frequency_penalty, req.presence_penalty, req.temperature) == (0.5, -0.5, pytest.approx(0.7))
    assert req.logit_bias == {"42": -100.0} and req.logprobs is True and req.top_logprobs == 3
    assert (req.max_tokens, req.max_completion_tokens, req.n, req.seed) == (10, 12, 1, 7)
    assert req.stop == ["\n", "END"] and req.stream is False and req.user == "u"
    assert req.tools[0].function.name == "get_weather" and req.tools[0].function.strict is True
    assert req.tools[0].function.parameters["properties"] == {"city": {"type": "string"}}
    assert req.tool_choice == NamedToolChoice(function={"name": "get_weather"})
    assert isinstance(req.response_format, ResponseFormatJsonSchema)
    assert req.response_format.json_schema.schema_ == {"type": "object"}
    assert req.tool_prompt == "Use a tool." and req.chat_template_kwargs == {"think": False}
    assert req.parallel_tool_calls is False


def test_chat_defaults_and_nulls_the_sdk_sends_for_none():
    req = ChatCompletionRequest.model_validate(
        {"messages": [USER], "model": None, "n": None, "stream": None, "logprobs": None,
         "temperature": None, "stop": None, "tool_choice": None, "stream_options": None})
    assert (req.model, req.n, req.stream, req.logprobs) == ("tgi", 1, False, False)
    assert req.temperature is None and req.stop is None and req.tool_choice is None
    assert ChatCompletionRequest.model_validate({"messages": [USER]}).model == "tgi"


def test_every_message_shape_the_sdk_sends_parses():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "sys", "name": "boss"},
        {"role": "user", "content": [{"type": "text", "text": "look: "},
                                     {"type": "image_url",
                                      "image_url": {"url": "http://x/cat.png", "detail": "low"}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "assistant", "refusal": None, "audio": None}]})
    system, user, call, tool, empty = req.messages
    assert system.name == "boss"
    assert isinstance(user.content[0], TextContentPart) and user.content[0].text == "look: "
    assert isinstance(user.content[1], ImageContentPart)
    assert user.content[1].image_url.url == "http://x/cat.png"
    assert call.content is None
    assert call.tool_calls == [ToolCall(id="call_1", function=FunctionCall(name="f", arguments="{\"a\": 1}"))]
    assert tool.tool_call_id == "call_1" and tool.content == "42"
    assert empty.content is None and empty.tool_calls is None


def test_stop_may_be_one_string():
    assert ChatCompletionRequest.model_validate({"messages": [USER], "stop": "\n"}).stop == "\n"


@pytest.mark.parametrize("choice", ["none", "auto", "required"])
def test_tool_choice_strings(choice):
    assert ChatCompletionRequest.model_validate({"messages": [USER], "tool_choice": choice}).tool_choice == choice


def test_tool_without_parameters_gets_an_empty_object_schema():
    req = ChatCompletionRequest.model_validate(
        {"messages": [USER], "tools": [{"type": "function", "function": {"name": "now"}}]})
    assert req.tools[0].function.parameters == {"type": "object", "properties": {}}


@pytest.mark.parametrize("fmt, kind, value", [
    ({"type": "text"}, ResponseFormatText, None),
    ({"type": "json_object"}, ResponseFormatJsonObject, None),
    ({"type": "json", "value": {"type": "object"}}, ResponseFormatJson, {"type": "object"}),
    ({"type": "json", "value": "{\"type\": \"object\"}"}, ResponseFormatJson, "{\"type\": \"object\"}"),
    ({"type": "regex", "value": "[ab]+"}, ResponseFormatRegex, "[ab]+"),
])
def test_response_formats_of_openai_and_tgi(fmt, kind, value):
    parsed = ChatCompletionRequest.model_validate({"messages": [USER], "response_format": fmt}).response_format
    assert isinstance(parsed, kind) and getattr(parsed, "value", None) == value


def test_json_schema_format_also_takes_tgis_value_key():
    fmt = ChatCompletionRequest.model_validate({"messages": [USER], "response_format": {
        "type": "json_schema", "value": {"name": "n", "schema": {"type": "integer"}}}}).response_format
    assert fmt.json_schema.name == "n" and fmt.json_schema.schema_ == {"type": "integer"}


def test_stream_options_include_usage():
    req = ChatCompletionRequest.model_validate(
        {"messages": [USER], "stream": True, "stream_options": {"include_usage": True,
                                                                "include_obfuscation": False}})
    assert req.stream and req.stream_options.include_usage


def test_every_completion_parameter_the_sdk_sends_parses(server):
    server.answer = dump(Completion(id="c", created=1, model="m", usage=USAGE, choices=[
        CompletionChoice(index=0, text="x", finish_reason="length")]))
    server.client.completions.create(
        model="m", prompt=["a", "b"], max_tokens=5, temperature=0.5, top_p=0.5, n=1,
        logprobs=2, echo=True, stop="\n", seed=3, frequency_penalty=0.1,
        presence_penalty=0.2, suffix="!", best_of=1, user="u", logit_bias={"1": 5})
    req = CompletionRequest.model_validate(server.bodies[0])
    assert req.prompt == ["a", "b"] and (req.max_tokens, req.n, req.logprobs, req.seed) == (5, 1, 2, 3)
    assert req.echo is True and req.stop == "\n" and req.suffix == "!" and req.best_of == 1
    assert req.temperature == 0.5 and req.top_p == 0.5 and req.user == "u"
    assert CompletionRequest.model_validate({"prompt": "x"}).echo is False


@pytest.mark.parametrize("body", [
    {"messages": []},
    {},
    {"messages": "hi"},
    {"messages": [{"role": "robot", "content": "hi"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "audio", "data": "x"}]}]},
    {"messages": [USER], "max_tokens": "5"},
    {"messages": [USER], "max_tokens": -1},
    {"messages": [USER], "n": 1.0},
    {"messages": [USER], "n": True},
    {"messages": [USER], "temperature": "hot"},
    {"messages": [USER], "temperature": math.nan},
    {"messages": [USER], "top_p": math.inf},
    {"messages": [USER], "stream": "yes"},
    {"messages": [USER], "stop": [1]},
    {"messages": [USER], "tools": [{"type": "custom", "custom": {"name": "x"}}]},
    {"messages": [USER], "tool_choice": "sometimes"},
    {"messages": [USER], "response_format": {"type": "yaml"}},
    {"messages": [USER], "response_format": {"type": "regex"}},
    {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
])
def test_garbage_chat_requests_are_validation_errors(body):
    with pytest.raises(pydantic.ValidationError):
        ChatCompletionRequest.model_validate(body)


def test_nan_in_json_text_is_a_validation_error():
    with pytest.raises(pydantic.ValidationError):
        ChatCompletionRequest.model_validate_json(
            '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}')


@pytest.mark.parametrize("body", [
    {}, {"prompt": 5}, {"prompt": [1, 2]}, {"prompt": "x", "logprobs": True},
    {"prompt": "x", "echo": "no"}, {"prompt": "x", "frequency_penalty": -math.inf},
])
def test_garbage_completion_requests_are_validation_errors(body):
    with pytest.raises(pydantic.ValidationError):
        CompletionRequest.model_validate(body)


# --------------------------------------------------------------- responses


def tool_call_completion() -> ChatCompletion:
    return ChatCompletion(
        id="chatcmpl-1", created=1700000000, model="smol", system_fingerprint="3.3.0-native",
        usage=USAGE, choices=[ChatChoice(index=0, finish_reason="tool_calls", message=AssistantMessage(
            content=None, tool_calls=[ToolCall(id="0", function=FunctionCall(
                name="get_weather", arguments="{\"city\": \"Paris\"}"))]))])


def test_chat_completion_writes_openais_nulls():
    choice = dump(tool_call_completion())["choices"][0]
    assert choice["logprobs"] is None and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0] == {
        "id": "0", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    text = dump(AssistantMessage(content="hello"))
    assert text == {"role": "assistant", "content": "hello"}


def test_chat_completion_round_trips_through_the_sdk_types():
    ours = tool_call_completion()
    sdk = SDKChatCompletion.model_validate(dump(ours))
    assert sdk.object == "chat.completion" and sdk.system_fingerprint == "3.3.0-native"
    assert sdk.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert sdk.usage.total_tokens == 7
    assert sdk.model_dump(mode="json", exclude_unset=True) == dump(ours)


def test_chat_completion_with_logprobs_reaches_an_sdk_client(server):
    logprobs = ChoiceLogprobs(content=[TokenLogprob(
        token="Hi", logprob=-0.25, bytes=[72, 105],
        top_logprobs=[TopLogprob(token="Hi", logprob=-0.25, bytes=[72, 105]),
                      TopLogprob(token="Yo", logprob=-math.inf, bytes=None)])])
    server.answer = dump(ChatCompletion(id="c", created=2, model="m", usage=USAGE, choices=[
        ChatChoice(index=0, message=AssistantMessage(content="Hi"), logprobs=logprobs, finish_reason="length")]))
    answer = server.client.chat.completions.create(model="m", messages=[USER], logprobs=True, top_logprobs=2)
    token = answer.choices[0].logprobs.content[0]
    assert (token.token, token.logprob, token.bytes) == ("Hi", -0.25, [72, 105])
    assert [t.logprob for t in token.top_logprobs] == [-0.25, -9999.0]
    assert answer.choices[0].message.content == "Hi" and answer.choices[0].finish_reason == "length"


def chunk(delta: ChunkDelta, finish_reason=None, **usage) -> ChatCompletionChunk:
    return ChatCompletionChunk(id="c", created=3, model="m", system_fingerprint="fp", **usage,
                               choices=[ChunkChoice(index=0, delta=delta, finish_reason=finish_reason)])


def test_chunk_deltas_omit_unset_fields():
    assert dump(ChunkDelta()) == {}
    assert dump(ChunkDelta(role="assistant", content="")) == {"role": "assistant", "content": ""}
    assert dump(ToolCallDelta(index=0, function=FunctionCallDelta(arguments="{\""))) == {
        "index": 0, "function": {"arguments": "{\""}}
    choice = dump(chunk(ChunkDelta(content="x")))["choices"][0]
    assert choice == {"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}


def test_chunk_writes_usage_only_when_the_route_passes_it():
    assert "usage" not in dump(chunk(ChunkDelta(content="x")))
    assert dump(chunk(ChunkDelta(content="x"), usage=None))["usage"] is None
    last = ChatCompletionChunk(id="c", created=3, model="m", choices=[], usage=USAGE)
    assert dump(last)["choices"] == [] and dump(last)["usage"]["total_tokens"] == 7


def test_chat_stream_with_usage_reaches_an_sdk_client(server):
    server.answer = [
        chunk(ChunkDelta(role="assistant", content=""), usage=None),
        chunk(ChunkDelta(content="Hel"), usage=None),
        chunk(ChunkDelta(content="lo"), finish_reason="stop", usage=None),
        ChatCompletionChunk(id="c", created=3, model="m", choices=[], usage=USAGE)]
    chunks = list(server.client.chat.completions.create(
        model="m", messages=[USER], stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content for c in chunks[:-1]) == "Hello"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert [c.usage for c in chunks[:-1]] == [None] * 3 and chunks[2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    assert server.bodies[0]["stream_options"] == {"include_usage": True}


def test_tool_call_stream_round_trips_through_the_sdk_types():
    first = chunk(ChunkDelta(role="assistant", tool_calls=[ToolCallDelta(
        index=0, id="0", type="function", function=FunctionCallDelta(name="f", arguments=""))]))
    rest = chunk(ChunkDelta(tool_calls=[ToolCallDelta(index=0, function=FunctionCallDelta(arguments="{}"))]),
                 finish_reason="tool_calls")
    for ours in (first, rest):
        sdk = SDKChatCompletionChunk.model_validate(dump(ours))
        assert sdk.model_dump(mode="json", exclude_unset=True) == dump(ours)
    assert SDKChatCompletionChunk.model_validate(dump(first)).choices[0].delta.tool_calls[0].function.name == "f"


def completion_logprobs() -> CompletionLogprobs:
    return CompletionLogprobs(tokens=["a", "b"], token_logprobs=[-0.5, -math.inf],
                              top_logprobs=[{"a": -0.5}, {"b": -math.inf}], text_offset=[0, 1])


def test_completion_round_trips_through_the_sdk_types():
    ours = Completion(id="cmpl-1", created=4, model="m", system_fingerprint="fp", usage=USAGE,
                      choices=[CompletionChoice(index=0, text="ab", logprobs=completion_logprobs(),
                                                finish_reason="stop")])
    data = dump(ours)
    assert data["object"] == "text_completion"
    assert data["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, -9999.0]
    assert data["choices"][0]["logprobs"]["top_logprobs"] == [{"a": -0.5}, {"b": -9999.0}]
    sdk = SDKCompletion.model_validate(data)
    assert sdk.model_dump(mode="json", exclude_unset=True) == data


def test_echoed_first_token_has_null_logprobs():
    logprobs = CompletionLogprobs(tokens=["a"], token_logprobs=[None], top_logprobs=[None], text_offset=[0])
    assert dump(logprobs)["token_logprobs"] == [None] and dump(logprobs)["top_logprobs"] == [None]


def test_completion_stream_reaches_an_sdk_client(server):
    def piece(text, finish_reason=None):
        return CompletionChunk(id="c", created=5, model="m", usage=None, choices=[
            CompletionChoice(index=0, text=text, finish_reason=finish_reason)])
    server.answer = [piece("a"), piece("b", "length"),
                     CompletionChunk(id="c", created=5, model="m", choices=[], usage=USAGE)]
    chunks = list(server.client.completions.create(
        model="m", prompt="x", stream=True, stream_options={"include_usage": True}))
    assert [c.choices[0].text for c in chunks[:2]] == ["a", "b"]
    assert chunks[0].object == "text_completion" and chunks[1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.total_tokens == 7 and chunks[-1].choices == []
    assert "usage" not in dump(CompletionChunk(id="c", created=5, model="m", choices=[]))


def test_model_list_reaches_an_sdk_client(server):
    model = Model(id="HuggingFaceTB/SmolLM2-135M-Instruct", created=0, owned_by="HuggingFaceTB")
    server.answer = dump(ModelList(data=[model]))
    assert server.answer["object"] == "list"
    models = list(server.client.models.list())
    assert [m.id for m in models] == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert SDKModel.model_validate(dump(model)).model_dump(mode="json", exclude_unset=True) == dump(model)


TRICKY_TEXTS = ["", "plain", " leading space", 'quote " and \\ backslash', "new\nline\ttab\r\x00\x1f\x7f",
                "caf\u00e9 \u4e2d\u6587 \U0001f600", "\u2028\u2029", "</script>", "\ufffd"]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_fast_token_chunks_are_the_bytes_the_models_write(text, include_usage):
    """A streamed token's chunk is built without a model per token: byte
    for byte the server-sent event of what the chunk models write, for any
    text and both usage modes."""
    def event(model: pydantic.BaseModel) -> bytes:
        return b"data: " + model.model_dump_json().encode() + b"\n\n"

    common = {"id": 'cmpl-"x"', "created": 1700000000, "model": "m\u00f6del \"q\"", "system_fingerprint": "fp",
              **({"usage": None} if include_usage else {})}
    completion = {"index": 2, "text": text, "logprobs": None, "finish_reason": None}
    assert (ChunkFrame(CompletionChunk, {**common, "object": "text_completion"}).event(completion)
            == event(CompletionChunk.model_validate({**common, "object": "text_completion", "choices": [completion]})))
    chat = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    chat_common = {**common, "object": "chat.completion.chunk"}
    assert (ChunkFrame(ChatCompletionChunk, chat_common).event(chat)
            == event(ChatCompletionChunk.model_validate({**chat_common, "choices": [chat]})))
