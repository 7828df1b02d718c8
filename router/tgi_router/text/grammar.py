"""Constrained-decoding grammars, built and checked at the edge.

Every grammar the shards receive is llguidance's grammar text (the JSON of
its TopLevelGrammar for a JSON Schema or a regex; Lark source as it is,
which llguidance reads directly) made here; the shards only compile it against the tokenizer and mask tokens.
llguidance imports without torch, parses JSON Schema, regex and Lark, and
bounds its own work by "fuel" (LLParserLimits), so a hostile grammar fails
instead of running away. Checking also runs in a worker with a deadline:
the route answers 422 in bounded time whatever the library does.

Each grammar also carries its shortest complete output
(tgi_proto.grammar_walk), so that validation can refuse a max_new_tokens that
cannot hold it, and JSON Schemas get bounds where they leave numbers
unbounded (`bounded_numbers`): a model that writes digits until the budget
runs out then meets the end of the number instead.
"""

import concurrent.futures
import functools
import json
from dataclasses import dataclass
from typing import Literal

from llguidance import LLMatcher

from tgi_proto.grammar_walk import walk
from tgi_router.errors import ValidationError

__all__ = ["JSON_OPTIONS", "CHECK_TIMEOUT_S", "INTEGER_RANGE", "NUMBER_RANGE", "NUMBER_STEP", "ValidGrammar",
           "bounded_numbers", "closed_schema", "json_grammar", "regex_grammar", "lark_grammar"]

# Compact JSON with one space after ',' and ':': flexible whitespace lets a
# small model emit newlines until max_tokens instead of closing the object.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CHECK_TIMEOUT_S = 5.0
_GRAMMAR_BYTES_MAX = 1_000_000  # beyond the payload limit anyway; refuse before parsing

# Defaults for numbers a schema leaves unbounded. An integer: a 64-bit
# integer's range (llguidance reads bounds as doubles, so the lower one is
# the double nearest above -2**63). A number: |x| <= 10**15 (a double's exact
# integers) with at most 6 digits after the point and no exponent.
INTEGER_RANGE = (-(2**63 - 1024), 2**63 - 1)
NUMBER_RANGE = (-1e15, 1e15)
NUMBER_STEP = 1e-6
_LOWER = ("minimum", "exclusiveMinimum")
_UPPER = ("maximum", "exclusiveMaximum")

# Keys whose value maps names to schemas, and keys whose value is data.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LITERALS = ("const", "enum", "default", "examples", "required")

_checker = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-check")


@dataclass(frozen=True)
class ValidGrammar:
    """A grammar that llguidance accepted. `type` and `source` say what the
    client sent (a JSON Schema as compact JSON, a regex, a Lark grammar);
    `text` is what the shards compile; `shortest` its shortest complete
    output (None when the walk found none within its budget)."""
    type: Literal["json", "regex", "lark"]
    source: str
    text: str
    shortest: str | None = None


def json_grammar(schema: dict) -> ValidGrammar:
    """A grammar for JSON texts valid under `schema`, its unbounded numbers
    bounded (`bounded_numbers`); raises ValidationError."""
    source = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    _check_size(source)
    try:
        text = LLMatcher.grammar_from_json_schema(json.dumps(bounded_numbers(schema)), overrides=JSON_OPTIONS)
    except ValueError as err:
        raise ValidationError(f"grammar is not valid: {err}") from None
    return _valid("json", source, text)


def bounded_numbers(schema):
    """`schema` with INTEGER_RANGE on every `integer` and NUMBER_RANGE and
    NUMBER_STEP on every `number` where the schema gives no bound (or step)
    of its own: unbounded, a small model can write digits until max_new_tokens."""
    return _each_schema(schema, _bounded)


def closed_schema(schema):
    """`schema` with `additionalProperties: false` on every object schema that
    lists properties and says nothing of others: OpenAI's strict mode. Without
    it JSON Schema admits any extra key, and small models invent some."""
    return _each_schema(schema, _closed)


def _each_schema(schema, fix):
    """`schema` rebuilt with fix() applied to every schema object in it,
    innermost first; literal values (const, enum, ...) are left as they are."""
    if isinstance(schema, list):
        return [_each_schema(s, fix) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _each_schema(s, fix) for name, s in value.items()}
        elif key in _LITERALS:
            out[key] = value
        else:
            out[key] = _each_schema(value, fix)
    return fix(out)


def _bounded(schema: dict) -> dict:
    types = schema.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    if "number" in types:
        low, high = NUMBER_RANGE
        schema.setdefault("multipleOf", NUMBER_STEP)
    elif "integer" in types:
        low, high = INTEGER_RANGE
    else:
        return schema
    if not any(k in schema for k in _LOWER):
        schema["minimum"] = low
    if not any(k in schema for k in _UPPER):
        schema["maximum"] = high
    return schema


def _closed(schema: dict) -> dict:
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def regex_grammar(pattern: str) -> ValidGrammar:
    """A grammar for texts that fully match `pattern`; raises ValidationError."""
    _check_size(pattern)
    return _valid("regex", pattern, LLMatcher.grammar_from_regex(pattern))


def lark_grammar(lark: str) -> ValidGrammar:
    """A grammar from llguidance's Lark dialect (with `%json {schema}`
    terminals); raises ValidationError."""
    _check_size(lark)
    return _valid("lark", lark, LLMatcher.grammar_from_lark(lark))


def _check_size(source: str) -> None:
    if len(source) > _GRAMMAR_BYTES_MAX:
        raise ValidationError(f"grammar is not valid: longer than {_GRAMMAR_BYTES_MAX} characters")


def _valid(kind: Literal["json", "regex", "lark"], source: str, text: str) -> ValidGrammar:
    future = _checker.submit(_analysis, text)
    try:
        problem, shortest = future.result(timeout=CHECK_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        raise ValidationError(
            f"grammar is not valid: it did not compile within {CHECK_TIMEOUT_S:g} s") from None
    if problem:
        raise ValidationError(f"grammar is not valid: {_one_line(problem)}")
    return ValidGrammar(kind, source, text, shortest)


def _one_line(problem: str, limit: int = 300) -> str:
    # llguidance's messages span lines (a caret under the error); keep the words.
    text = " ".join(problem.split())
    return text if len(text) <= limit else text[:limit] + "..."


@functools.lru_cache(maxsize=512)
def _analysis(text: str) -> tuple[str, str | None]:
    """(llguidance's error for the grammar, "" when it compiles; its shortest
    complete output, None when unknown)."""
    problem = LLMatcher.validate_grammar(text)
    if problem:
        return problem, None
    try:
        shortest = walk(text).shortest()
    except ValueError:  # valid for a model's vocabulary but not for bytes alone
        return "", None
    return "", None if shortest is None else shortest.decode("utf-8", errors="replace")
