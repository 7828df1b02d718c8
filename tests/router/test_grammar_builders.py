"""The grammar builders make llguidance grammar text from a JSON Schema, a
regex or a Lark grammar, refuse broken ones with a one-line 422, refuse
oversized sources before parsing and a check that outlasts its deadline
without waiting for it; `closed_schema` is OpenAI's strict mode. Acceptance is checked with a
real llguidance matcher over a byte-level tokenizer (one token per byte)."""

import copy
import json
import threading

import pytest

from tgi_router.errors import ValidationError, error_response
from tgi_router.text import grammar as grammar_module
from tgi_router.text.grammar import (
    JSON_OPTIONS,
    ValidGrammar,
    bounded_numbers,
    closed_schema,
    json_grammar,
    lark_grammar,
    regex_grammar,
)

# --------------------------------------------------------------- matcher


def grammars_of(valid: ValidGrammar) -> list[dict]:
    return json.loads(valid.text)["grammars"]


def refused(build, *args) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        build(*args)
    err = info.value
    assert err.detail.startswith("grammar is not valid: ")
    assert "\n" not in err.detail and "\r" not in err.detail
    assert error_response(err) == (422, {"error": f"Input validation error: {err.detail}",
                                         "error_type": "validation"})
    return err


# ------------------------------------------------------------- builders

def test_json_grammar_carries_the_schema_and_compact_options():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    valid = json_grammar(schema)
    assert valid.type == "json"
    assert json.loads(valid.source) == schema and " " not in valid.source
    [g] = grammars_of(valid)
    assert g["json_schema"]["x-guidance"] == JSON_OPTIONS
    assert {k: v for k, v in g["json_schema"].items() if k != "x-guidance"} == bounded_numbers(schema)


def test_json_grammar_text_is_compact_json_with_one_space(accepts):
    valid = json_grammar({"type": "object", "properties": {"a": {"type": "integer"}},
                          "required": ["a"]})
    assert accepts(valid.text, '{"a": 1}')
    assert not accepts(valid.text, '{"a":1}')
    assert not accepts(valid.text, '{"a": 1}\n')
    assert not accepts(valid.text, '{"a": "1"}')
    assert not accepts(valid.text, '{}')


def test_regex_grammar(accepts):
    valid = regex_grammar(r"[0-9]{3}-[a-z]+")
    assert (valid.type, valid.source) == ("regex", r"[0-9]{3}-[a-z]+")
    assert len(grammars_of(valid)) == 1
    assert accepts(valid.text, "123-abc")
    assert not accepts(valid.text, "12-abc")
    assert not accepts(valid.text, "123-abc!")


def test_lark_grammar(accepts):
    lark = 'start: "yes" | "no" | num\nnum: /[0-9]+/\n'
    valid = lark_grammar(lark)
    # llguidance's grammar text for Lark is the Lark source itself; LLMatcher
    # takes it as it takes the JSON form the other builders make.
    assert (valid.type, valid.source, valid.text) == ("lark", lark, lark)
    assert accepts(valid.text, "yes") and accepts(valid.text, "42")
    assert not accepts(valid.text, "maybe")


def test_lark_grammar_with_a_json_terminal(accepts):
    valid = lark_grammar('start: "A=" obj\nobj: %json {"type": "object", "properties": '
                         '{"x": {"type": "boolean"}}, "required": ["x"], "additionalProperties": false}\n')
    # Without x-guidance options a %json terminal takes any JSON whitespace.
    assert accepts(valid.text, 'A={"x": true}') and accepts(valid.text, 'A={"x":true}')
    assert not accepts(valid.text, 'A={"x": 1}')


# -------------------------------------------------------------- refusals

@pytest.mark.parametrize("pattern", ["[0-9", "(ab", "a{2,1}", "*a"])
def test_broken_regex_is_a_one_line_422(pattern):
    refused(regex_grammar, pattern)


def test_regex_message_keeps_llguidances_words_on_one_line():
    err = refused(regex_grammar, "[0-9")
    assert "unclosed character class" in err.detail


@pytest.mark.parametrize("schema, words", [
    ({"type": "foo"}, "foo"),
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "strin"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"type": "object", "properties": {"a": {"$ref": "#/definitions/nope"}}}, "nope"),
])
def test_broken_json_schema_is_a_one_line_422(schema, words):
    assert words in refused(json_grammar, schema).detail


@pytest.mark.parametrize("lark", ["start: foo", "start: (", "start: /[a-/", "this is not lark"])
def test_broken_lark_is_a_one_line_422(lark):
    refused(lark_grammar, lark)


def test_long_messages_are_cut():
    err = refused(lark_grammar, "start: " + " | ".join(f"undefined_rule_{i}" for i in range(200)))
    assert len(err.detail) <= len("grammar is not valid: ") + 303


class _NoParse:
    """Stands in for LLMatcher: any use means the source was parsed."""
    def __getattr__(self, name):
        raise AssertionError(f"LLMatcher.{name} called for an oversized source")


@pytest.mark.parametrize("build, source", [
    (regex_grammar, "a" * 101),
    (lark_grammar, 'start: "' + "a" * 101 + '"'),
    (json_grammar, {"type": "string", "description": "d" * 101}),
])
def test_oversized_sources_are_refused_before_parsing(monkeypatch, build, source):
    monkeypatch.setattr(grammar_module, "_GRAMMAR_BYTES_MAX", 100)
    monkeypatch.setattr(grammar_module, "LLMatcher", _NoParse())
    monkeypatch.setattr(grammar_module, "_analysis", lambda text: pytest.fail("checked an oversized source"))
    err = refused(build, source)
    assert err.detail == "grammar is not valid: longer than 100 characters"


def test_the_real_size_limit_is_refused_before_parsing(monkeypatch):
    monkeypatch.setattr(grammar_module, "LLMatcher", _NoParse())
    monkeypatch.setattr(grammar_module, "_analysis", lambda text: pytest.fail("checked an oversized source"))
    limit = grammar_module._GRAMMAR_BYTES_MAX
    assert refused(regex_grammar, "a" * (limit + 1)).detail == f"grammar is not valid: longer than {limit} characters"


def test_a_source_at_the_limit_is_parsed(monkeypatch):
    monkeypatch.setattr(grammar_module, "_GRAMMAR_BYTES_MAX", 100)
    assert regex_grammar("a" * 100).source == "a" * 100


def test_a_check_past_the_deadline_is_a_422_without_waiting_for_the_check(monkeypatch):
    release, started, finished = threading.Event(), threading.Event(), threading.Event()

    def hung_check(text):
        started.set()
        release.wait(60)
        finished.set()
        return "", None

    monkeypatch.setattr(grammar_module, "CHECK_TIMEOUT_S", 0.05)
    monkeypatch.setattr(grammar_module, "_analysis", hung_check)
    try:
        err = refused(regex_grammar, "[a-z]+ but never checked before")
        # Refused while the check still hangs: it ends only when released.
        assert started.is_set() and not finished.is_set()
    finally:
        release.set()  # free the checker's worker thread
    assert err.detail == "grammar is not valid: it did not compile within 0.05 s"


def test_the_checker_reports_llguidances_problem(monkeypatch):
    monkeypatch.setattr(grammar_module, "_analysis", lambda text: ("line one\n   ^ here\n", None))
    assert refused(regex_grammar, "abc").detail == "grammar is not valid: line one ^ here"


# --------------------------------------------------------- closed_schema

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "default": {"type": "object", "properties": {"k": {}}}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"t": {"type": "string"}}}},
        "pick": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                           {"type": "string"}]},
        "kind": {"enum": [{"type": "object", "properties": {"x": 1}}, "plain"]},
        "fixed": {"const": {"properties": {"y": 2}}},
        "ref": {"$ref": "#/$defs/Thing"},
        "open": {"type": "object", "properties": {"o": {}}, "additionalProperties": True},
        "typed": {"type": "object", "properties": {"p": {}}, "additionalProperties": {"type": "integer"}},
        "map": {"type": "object"},
    },
    "required": ["name"],
    "$defs": {"Thing": {"type": "object", "properties": {"z": {"type": "number"}}}},
}


def test_closed_schema_closes_every_object_with_properties():
    closed = closed_schema(PERSON)
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["address"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["pick"]["anyOf"][0]["additionalProperties"] is False
    assert props["pick"]["anyOf"][1] == {"type": "string"}
    assert closed["$defs"]["Thing"]["additionalProperties"] is False
    assert "additionalProperties" not in props["map"]  # no properties: a free map stays free
    assert "additionalProperties" not in props["name"]


def test_closed_schema_leaves_explicit_additional_properties_alone():
    props = closed_schema(PERSON)["properties"]
    assert props["open"]["additionalProperties"] is True
    assert props["typed"]["additionalProperties"] == {"type": "integer"}


def test_closed_schema_never_touches_literal_values():
    props = closed_schema(PERSON)["properties"]
    assert props["name"]["default"] == PERSON["properties"]["name"]["default"]
    assert props["kind"]["enum"] == PERSON["properties"]["kind"]["enum"]
    assert props["fixed"]["const"] == {"properties": {"y": 2}}
    assert closed_schema(PERSON)["required"] == ["name"]


def test_closed_schema_does_not_change_its_argument():
    before = copy.deepcopy(PERSON)
    closed_schema(PERSON)
    assert PERSON == before


def test_a_property_named_properties_is_a_property():
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "enum": {"type": "object", "properties": {"y": {"type": "integer"}}},
        "additionalProperties": {"type": "string"}}}
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False
    assert set(closed["properties"]) == {"properties", "enum", "additionalProperties"}
    assert closed["properties"]["properties"] == {
        "type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": False}
    assert closed["properties"]["enum"]["additionalProperties"] is False
    assert closed["properties"]["additionalProperties"] == {"type": "string"}


def test_closed_schema_passes_non_schemas_through():
    assert closed_schema(True) is True
    assert closed_schema({}) == {}
    assert closed_schema([{"type": "object", "properties": {}}]) == [
        {"type": "object", "properties": {}, "additionalProperties": False}]


def test_the_closed_grammar_rejects_an_extra_key_the_open_one_accepts(accepts):
    schema = {"type": "object", "properties": {
        "a": {"type": "integer"},
        "inner": {"type": "object", "properties": {"b": {"type": "boolean"}}}}, "required": ["a"]}
    open_text, closed_text = json_grammar(schema).text, json_grammar(closed_schema(schema)).text
    for text in ('{"a": 1}', '{"a": 1, "inner": {"b": true}}'):
        assert accepts(open_text, text) and accepts(closed_text, text)
    for extra in ('{"a": 1, "zzz": 2}', '{"a": 1, "inner": {"b": true, "c": 0}}'):
        assert accepts(open_text, extra)
        assert not accepts(closed_text, extra)


def test_a_closed_literal_stays_a_literal_in_the_grammar(accepts):
    schema = {"type": "object", "properties": {"k": {"const": {"properties": {"y": 2}}}},
              "required": ["k"]}
    text = json_grammar(closed_schema(schema)).text
    assert accepts(text, '{"k": {"properties": {"y": 2}}}')
    assert not accepts(text, '{"k": {"properties": {"y": 3}}}')
