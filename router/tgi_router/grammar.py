"""Constrained-decoding grammars, built and checked at the edge.

Every grammar the shards receive is llguidance's grammar text (the JSON of
its TopLevelGrammar for a JSON Schema or a regex; Lark source as it is,
which llguidance reads directly) made here; the shards only compile it against the tokenizer and mask tokens.
llguidance imports without torch, parses JSON Schema, regex and Lark, and
bounds its own work by "fuel" (LLParserLimits), so a hostile grammar fails
instead of running away. Checking also runs in a worker with a deadline:
the route answers 422 in bounded time whatever the library does.
"""

import concurrent.futures
import functools
import json
from dataclasses import dataclass
from typing import Literal

from llguidance import LLMatcher

from .errors import ValidationError

__all__ = ["JSON_OPTIONS", "CHECK_TIMEOUT_S", "ValidGrammar", "closed_schema", "json_grammar",
           "regex_grammar", "lark_grammar"]

# Compact JSON with one space after ',' and ':': flexible whitespace lets a
# small model emit newlines until max_tokens instead of closing the object.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CHECK_TIMEOUT_S = 5.0
_GRAMMAR_BYTES_MAX = 1_000_000  # beyond the payload limit anyway; refuse before parsing

# Keys whose value maps names to schemas, and keys whose value is data.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LITERALS = ("const", "enum", "default", "examples", "required")

_checker = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-check")


@dataclass(frozen=True)
class ValidGrammar:
    """A grammar that llguidance accepted. `type` and `source` say what the
    client sent (a JSON Schema as compact JSON, a regex, a Lark grammar);
    `text` is what the shards compile."""
    type: Literal["json", "regex", "lark"]
    source: str
    text: str


def json_grammar(schema: dict) -> ValidGrammar:
    """A grammar for JSON texts valid under `schema`; raises ValidationError."""
    source = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    _check_size(source)
    try:
        text = LLMatcher.grammar_from_json_schema(source, overrides=JSON_OPTIONS)
    except ValueError as err:
        raise ValidationError(f"grammar is not valid: {err}") from None
    return ValidGrammar("json", source, _checked(text))


def closed_schema(schema):
    """`schema` with `additionalProperties: false` on every object schema that
    lists properties and says nothing of others: OpenAI's strict mode. Without
    it JSON Schema admits any extra key, and small models invent some."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_schema(s) for name, s in value.items()}
        elif key in _LITERALS:
            out[key] = value
        else:
            out[key] = closed_schema(value)
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def regex_grammar(pattern: str) -> ValidGrammar:
    """A grammar for texts that fully match `pattern`; raises ValidationError."""
    _check_size(pattern)
    return ValidGrammar("regex", pattern, _checked(LLMatcher.grammar_from_regex(pattern)))


def lark_grammar(lark: str) -> ValidGrammar:
    """A grammar from llguidance's Lark dialect (with `%json {schema}`
    terminals); raises ValidationError."""
    _check_size(lark)
    return ValidGrammar("lark", lark, _checked(LLMatcher.grammar_from_lark(lark)))


def _check_size(source: str) -> None:
    if len(source) > _GRAMMAR_BYTES_MAX:
        raise ValidationError(f"grammar is not valid: longer than {_GRAMMAR_BYTES_MAX} characters")


def _checked(text: str) -> str:
    future = _checker.submit(_problem, text)
    try:
        problem = future.result(timeout=CHECK_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        raise ValidationError(
            f"grammar is not valid: it did not compile within {CHECK_TIMEOUT_S:g} s") from None
    if problem:
        raise ValidationError(f"grammar is not valid: {_one_line(problem)}")
    return text


def _one_line(problem: str, limit: int = 300) -> str:
    # llguidance's messages span lines (a caret under the error); keep the words.
    text = " ".join(problem.split())
    return text if len(text) <= limit else text[:limit] + "..."


@functools.lru_cache(maxsize=512)
def _problem(text: str) -> str:
    """llguidance's error for the grammar, "" when it compiles."""
    return LLMatcher.validate_grammar(text)
