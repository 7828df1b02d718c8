"""Tool calling: the plan (tools shown, grammar imposed) for each
tool_choice, what those grammars admit (checked with a real llguidance
matcher over a byte-level tokenizer), reading a finished call back, and
splitting a streamed call into its name and argument fragments."""

import json

import pytest

from tgi_router.errors import ToolError, error_response
from tgi_router.openai_compat.tool_calls import (
    ToolCall,
    ToolCallStream,
    ToolPlan,
    new_call_id,
    parse_tool_call,
    plan_tools,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city {in braces}",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: no arguments
TOOLS = [WEATHER, TIME, PING]

VALID_CALLS = {
    "get_weather": ['{"name": "get_weather", "arguments": {"city": "Paris"}}',
                    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'],
    "get_time": ['{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'],
    "ping": ['{"name": "ping", "arguments": {}}'],
}
INVALID_CALLS = {
    "arguments before name": '{"arguments": {"city": "Paris"}, "name": "get_weather"}',
    "unknown tool": '{"name": "get_wether", "arguments": {"city": "Paris"}}',
    "extra argument": '{"name": "get_weather", "arguments": {"city": "Paris", "country": "FR"}}',
    "argument of another tool": '{"name": "get_time", "arguments": {"city": "Paris"}}',
    "missing required argument": '{"name": "get_weather", "arguments": {}}',
    "wrong argument type": '{"name": "get_weather", "arguments": {"city": 75}}',
    "enum value not listed": '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "k"}}',
    "arguments of ping": '{"name": "ping", "arguments": {"x": 1}}',
    "extra top-level key": '{"name": "ping", "arguments": {}, "id": 1}',
    "no arguments": '{"name": "ping"}',
    "compact separators": '{"name":"ping","arguments":{}}',
    "trailing text": '{"name": "ping", "arguments": {}} ok',
}


# ------------------------------------------------------------------ plans

@pytest.mark.parametrize("tools, choice", [
    (None, None), ([], None), ([], "required"), (None, "auto"),
    (TOOLS, "none"), ([WEATHER], "none"),
])
def test_no_tools_or_none_means_no_grammar_and_no_tools_shown(tools, choice):
    assert plan_tools(tools, choice) == ToolPlan(tools=None, grammar=None)


def test_auto_is_a_lark_grammar_and_shows_the_tools():
    for choice in ("auto", None):  # None with tools means "auto", as OpenAI
        plan = plan_tools(TOOLS, choice)
        assert plan.tools == TOOLS
        assert plan.grammar.type == "lark"
        assert plan.grammar.source.startswith("start: call | text\n")


def test_required_is_a_json_grammar_over_every_tool():
    plan = plan_tools(TOOLS, "required")
    assert plan.tools == TOOLS and plan.grammar.type == "json"
    schema = json.loads(plan.grammar.source)
    assert [c["properties"]["name"] for c in schema["anyOf"]] == [
        {"const": "get_weather"}, {"const": "get_time"}, {"const": "ping"}]
    assert all(c["additionalProperties"] is False for c in schema["anyOf"])
    assert all(c["properties"]["arguments"]["additionalProperties"] is False for c in schema["anyOf"])


def test_a_named_function_is_a_json_grammar_over_that_tool_only():
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert plan.tools == TOOLS  # the model still sees every tool
    schema = json.loads(plan.grammar.source)
    assert "anyOf" not in schema and schema["properties"]["name"] == {"const": "get_time"}


def test_a_single_tool_under_required_has_no_any_of():
    schema = json.loads(plan_tools([WEATHER], "required").grammar.source)
    assert "anyOf" not in schema and schema["properties"]["name"] == {"const": "get_weather"}


def test_an_unknown_named_function_is_a_tool_error():
    with pytest.raises(ToolError) as info:
        plan_tools(TOOLS, {"type": "function", "function": {"name": "get_wether"}})
    assert info.value.detail == "Tool choice 'get_wether' not found in the tools"
    assert error_response(info.value) == (
        422, {"error": "Tool error: Tool choice 'get_wether' not found in the tools",
              "error_type": "tool_error"})


@pytest.mark.parametrize("choice", ["auto", "required", None,
                                    {"type": "function", "function": {"name": "get_time"}}])
def test_duplicate_tool_names_are_a_tool_error(choice):
    with pytest.raises(ToolError) as info:
        plan_tools([WEATHER, TIME, WEATHER], choice)
    assert info.value.status == 422 and "unique" in info.value.detail


def test_plans_do_not_change_the_callers_tools():
    tools = json.loads(json.dumps(TOOLS))
    plan_tools(tools, "required")
    plan_tools(tools, "auto")
    assert tools == TOOLS


def test_call_ids_are_fresh():
    ids = {new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(i.startswith("call_") and len(i) == 29 for i in ids)


# ---------------------------------------------------- what grammars admit

@pytest.fixture(scope="module")
def required_text():
    return plan_tools(TOOLS, "required").grammar.text


@pytest.fixture(scope="module")
def auto_text():
    return plan_tools(TOOLS, "auto").grammar.text


@pytest.mark.parametrize("text", [t for calls in VALID_CALLS.values() for t in calls])
def test_required_accepts_a_valid_call_of_each_tool(accepts, required_text, auto_text, text):
    assert accepts(required_text, text)
    assert accepts(auto_text, text)


@pytest.mark.parametrize("why", list(INVALID_CALLS))
def test_required_and_auto_reject_a_malformed_call(accepts, required_text, auto_text, why):
    assert not accepts(required_text, INVALID_CALLS[why])
    assert not accepts(auto_text, INVALID_CALLS[why])


@pytest.mark.parametrize("text", ["Hello", "It is sunny.\nAnything { goes } here", " {\"name\": ",
                                  "[1, 2]", "é"])
def test_auto_accepts_free_text_not_starting_with_a_brace(accepts, auto_text, required_text, text):
    assert accepts(auto_text, text)
    assert not accepts(required_text, text)


@pytest.mark.parametrize("text", ["{", "{}", "{hello}", '{"name": "get_weather"}', '{"text": "hi"}'])
def test_under_auto_a_brace_must_start_a_valid_call(accepts, auto_text, text):
    assert not accepts(auto_text, text)


def test_a_named_function_admits_only_that_tool(accepts):
    text = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}).grammar.text
    assert accepts(text, VALID_CALLS["get_time"][0])
    assert not accepts(text, VALID_CALLS["get_weather"][0])
    assert not accepts(text, VALID_CALLS["ping"][0])


def test_parameters_left_open_are_closed_but_explicit_openness_is_kept(accepts):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}},
        "additionalProperties": {"type": "integer"}}}}
    text = plan_tools([tool], "required").grammar.text
    assert accepts(text, '{"name": "f", "arguments": {"a": 1, "b": 2}}')
    assert not accepts(text, '{"name": "f", "arguments": {"a": 1, "b": "x"}}')


# ------------------------------------------------------------ reading back

@pytest.mark.parametrize("text, name, arguments", [
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', "get_weather", '{"city": "Paris"}'),
    ('{"name": "ping", "arguments": {}}', "ping", "{}"),
    ('{"name": "f", "arguments": {"arguments": {"n": "x}"}, "b": [1, {}]}}', "f",
     '{"arguments": {"n": "x}"}, "b": [1, {}]}'),
    ('{"name": "f", "arguments": {"s": "caf\\u00e9 \\"q\\""}}', "f", '{"s": "caf\\u00e9 \\"q\\""}'),
])
def test_parse_tool_call_keeps_the_arguments_exactly_as_generated(text, name, arguments):
    call = parse_tool_call(text)
    assert call == ToolCall(name, arguments)
    assert json.loads(call.arguments) == json.loads(text)["arguments"]


@pytest.mark.parametrize("text", ["", "Hello", ' {"name": "ping", "arguments": {}}', "[1]",
                                  '{"name": "get_weather", "arguments": {"city": "Par',
                                  '{"name": "get_weather", "arguments": {"city": "Paris"}',
                                  '{"name": "ping"', "{", '{"name": 3, "arguments": {}}',
                                  '{"arguments": {}}', '{"name": "ping"}'])
def test_parse_tool_call_answers_none_for_no_complete_call(text):
    assert parse_tool_call(text) is None


# --------------------------------------------------------------- streaming

CALL = '{"name": "get_weather", "arguments": {"city": "Paris {", "unit": "c"}}'


def chunked(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def stream(chunks: list[str], may_call: bool = True) -> tuple[ToolCallStream, list[tuple[str, str]]]:
    splitter = ToolCallStream(may_call)
    parts = []
    for chunk in chunks:
        parts += splitter.feed(chunk)
    parts += splitter.finish()
    return splitter, parts


CHUNKINGS = {
    "one char": chunked(CALL, 1),
    "three chars": chunked(CALL, 3),
    "whole": [CALL],
    "tokens": ['{"', "name", '":', ' "', "get", "_weather", '",', ' "', "arguments", '":',
               " {", '"city', '":', ' "', "Paris", " {", '",', ' "unit', '":', ' "c', '"}', "}"],
    "name end and arguments start together": ['{"name": "get_', 'weather", "arguments": {"ci',
                                              'ty": "Paris {", "unit": "c"}', "}"],
    "closing braces together": [CALL[:-2], "}}"],
    "empty chunks between": ["", '{"name": "get_weather", ', "", '"arguments": ', "",
                             '{"city": "Paris {", "unit": "c"}}', ""],
    "key cut before its space": ['{"name": "get_weather", "arguments":', ' {"city": "Paris {", "unit": "c"}}'],
}


@pytest.mark.parametrize("how", list(CHUNKINGS))
def test_a_streamed_call_is_its_name_once_then_its_arguments(how):
    chunks = CHUNKINGS[how]
    assert "".join(chunks) == CALL
    splitter, parts = stream(chunks)
    assert splitter.is_call
    kinds = [kind for kind, _ in parts]
    assert kinds.count("name") == 1 and kinds[0] == "name"
    assert set(kinds[1:]) == {"arguments"}
    assert parts[0] == ("name", "get_weather")
    assert all(fragment for _, fragment in parts)
    assert "".join(fragment for _, fragment in parts[1:]) == parse_tool_call(CALL).arguments


def test_the_name_is_sent_as_soon_as_the_arguments_key_is_complete():
    splitter = ToolCallStream(may_call=True)
    assert splitter.feed('{"name": "get_weather", "argu') == []
    assert splitter.is_call
    assert splitter.feed('ments": ') == [("name", "get_weather")]
    assert splitter.feed("{") == []  # the last character is held back
    assert splitter.feed('"a": 1}') == [("arguments", '{"a": 1')]
    assert splitter.feed("}") == [("arguments", "}")]
    assert splitter.finish() == []


def test_a_truncated_call_sends_what_it_has_at_the_end():
    splitter, parts = stream(['{"name": "ping", "arguments": {"a": [1, 2'])
    assert parts[0] == ("name", "ping")
    assert "".join(fragment for _, fragment in parts[1:]) == '{"a": [1, 2'
    splitter, parts = stream(['{"name": "pi'])
    assert splitter.is_call and parts == []


@pytest.mark.parametrize("text", ['{"name": "f", "arguments": {"a": {}',
                                  '{"name": "f", "arguments": {"a": [{"b": 1}',
                                  '{"name": "f", "arguments": {"s": "}"'])
def test_a_truncated_call_ending_in_a_brace_keeps_that_brace(text):
    """Only the brace that closes a complete call is not part of the arguments."""
    assert parse_tool_call(text) is None
    for chunks in ([text], chunked(text, 1), chunked(text, 4)):
        _, parts = stream(chunks)
        assert "".join(fragment for _, fragment in parts[1:]) == text[text.index("{", 1):]


@pytest.mark.parametrize("chunks", [["Hello", " world"], list("Hi {there}"), ["", "", "ok", "", "!"],
                                    [" ", '{"name": "ping", "arguments": {}}']])
def test_content_passes_through_unchanged(chunks):
    splitter, parts = stream(chunks)
    assert not splitter.is_call
    assert {kind for kind, _ in parts} == {"content"}
    assert "".join(text for _, text in parts) == "".join(chunks)
    assert all(text for _, text in parts)


def test_content_chunks_are_sent_as_they_come():
    splitter = ToolCallStream(may_call=True)
    assert splitter.feed("He") == [("content", "He")]
    assert splitter.feed("llo {") == [("content", "llo {")]
    assert splitter.feed("") == []
    assert splitter.finish() == []


def test_leading_empty_chunks_wait_for_the_first_character():
    splitter = ToolCallStream(may_call=True)
    assert splitter.feed("") == [] and splitter.feed("") == []
    assert not splitter.is_call
    assert splitter.feed("{") == [] and splitter.is_call

    splitter = ToolCallStream(may_call=True)
    assert splitter.feed("") == []
    assert splitter.feed("Sure") == [("content", "Sure")]
    assert not splitter.is_call


@pytest.mark.parametrize("how", list(CHUNKINGS))
def test_without_tools_a_call_shaped_text_is_content(how):
    splitter, parts = stream(CHUNKINGS[how], may_call=False)
    assert not splitter.is_call
    assert {kind for kind, _ in parts} == {"content"}
    assert "".join(text for _, text in parts) == CALL
