"""The grammar walk finds complete, short outputs from any point of a JSON
Schema, regex or tool-call grammar; the builders bound unbounded numbers; a
budget below the shortest output is a 422 naming it. Every completion is
checked by a real llguidance matcher (the walk's own byte vocabulary)."""

import json
import re

import jsonschema
import pytest

from tgi_proto.grammar_walk import GrammarWalk, is_json_grammar
from tgi_router.errors import ValidationError
from tgi_router.openai_compat.tool_calls import plan_tools
from tgi_router.request.validation import check_grammar_budget
from tgi_router.text.grammar import (
    INTEGER_RANGE,
    NUMBER_RANGE,
    NUMBER_STEP,
    bounded_numbers,
    json_grammar,
    regex_grammar,
)

COLOR = {"type": "object", "properties": {"color": {"enum": ["green", "red", "yellow"]},
                                          "count": {"type": "integer"}, "flag": {"type": "boolean"}},
         "required": ["color", "count", "flag"]}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}}, "required": ["name", "tags", "address"]}
ITEMS = {"type": "object", "properties": {"items": {"type": "array", "minItems": 2, "items": {
    "type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
    "required": ["sku", "qty"]}}}, "required": ["items"]}


@pytest.mark.parametrize("schema, shortest", [
    (COLOR, '{"color": "red", "count": 0, "flag": true}'),
    (PERSON, '{"name": "", "tags": [], "address": {"city": "", "zip": "00000"}}'),
    (ITEMS, '{"items": [{"sku": "", "qty": 0}, {"sku": "", "qty": 0}]}'),
])
def test_the_shortest_json_output_is_found_and_valid(schema, shortest):
    found = json_grammar(schema).shortest
    assert len(found) == len(shortest)  # digits and enum values of equal length are as short
    jsonschema.validate(json.loads(found), schema)


@pytest.mark.parametrize("schema, prefix", [
    (COLOR, '{"color": "gr'),
    (COLOR, '{"color": "red", "count": 12345'),
    (PERSON, '{"name": "Ada Lovel'),
    (PERSON, '{"name": "Ada", "tags": ["x", "y'),
    (PERSON, '{"name": "Ada", "tags": [], "address": {"city": "London", "zip": "12'),
    (ITEMS, '{"items": [{"sku": "a1", "qty": 3}'),
])
def test_completions_from_the_middle_complete_the_document(schema, prefix):
    walk = GrammarWalk(json_grammar(schema).text)
    state = walk.start()
    assert state.advance(prefix.encode())
    for nodes in (0, 400):  # the dive alone, and with the bounded search
        tail = state.shortest(nodes)
        assert state.completes(tail)
        jsonschema.validate(json.loads(prefix + tail.decode()), schema)
    assert not state.completes(b"")


@pytest.mark.parametrize("pattern, prefix", [
    (r"[a-z]{3,10}@[a-z]+\.(com|org)", ""), (r"[a-z]{3,10}@[a-z]+\.(com|org)", "ab"),
    (r"\d{3}-\d{3}-\d{4}", "12"), (r"[A-Z]{20}", ""), (r"(yes|no), because [a-z ]+\.", "no, bec"),
])
def test_regex_completions_fully_match(pattern, prefix):
    walk = GrammarWalk(regex_grammar(pattern).text)
    state = walk.start()
    assert state.advance(prefix.encode())
    assert re.fullmatch(pattern, prefix + state.shortest(400).decode())


def test_a_required_tool_call_has_a_shortest_call():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}}]
    grammar = plan_tools(tools, "required").grammar
    assert is_json_grammar(grammar.text)
    call = json.loads(grammar.shortest)
    assert call["name"] == "add" and set(call["arguments"]) == {"a", "b"}


def test_unbounded_numbers_get_bounds_and_given_bounds_stay():
    schema = {"type": "object", "properties": {
        "i": {"type": "integer"}, "n": {"type": ["number", "null"]}, "low": {"type": "integer", "minimum": 0},
        "step": {"type": "number", "multipleOf": 0.5}, "items": {"type": "array", "items": {"type": "integer"}},
        "e": {"enum": [1, 2]}}}
    out = bounded_numbers(schema)["properties"]
    assert (out["i"]["minimum"], out["i"]["maximum"]) == INTEGER_RANGE
    assert (out["n"]["minimum"], out["n"]["maximum"], out["n"]["multipleOf"]) == NUMBER_RANGE + (NUMBER_STEP,)
    assert out["low"]["minimum"] == 0 and out["low"]["maximum"] == INTEGER_RANGE[1]
    assert out["step"]["multipleOf"] == 0.5
    assert out["items"]["items"]["maximum"] == INTEGER_RANGE[1]
    assert out["e"] == {"enum": [1, 2]}


def test_a_bounded_integer_ends_at_nineteen_digits():
    walk = GrammarWalk(json_grammar({"type": "integer"}).text)
    state = walk.start()
    assert state.advance(b"9223372036854775807")
    assert state.accepting() and not state.completes(b"0")
    assert not walk.start().advance(b"92233720368547758070")


def test_a_number_has_at_most_six_decimals_and_no_exponent():
    walk = GrammarWalk(json_grammar({"type": "number"}).text)
    assert walk.start().completes(b"-12.345678")
    assert not walk.start().completes(b"1.2345678")
    assert not walk.start().completes(b"1e5")


def test_a_budget_below_the_shortest_output_is_a_422_naming_it():
    grammar = json_grammar(COLOR)
    count = len  # one token per character, for the test
    check_grammar_budget(grammar, len(grammar.shortest), count)
    with pytest.raises(ValidationError) as info:
        check_grammar_budget(grammar, len(grammar.shortest) - 1, count)
    assert info.value.detail == (
        f"`max_new_tokens` must be at least {len(grammar.shortest)} for this grammar: its shortest valid "
        f"output, {grammar.shortest!r}, is {len(grammar.shortest)} tokens. Given: {len(grammar.shortest) - 1}")
