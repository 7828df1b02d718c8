"""Validation applies TGI's rules in TGI's order with TGI's exact messages,
and freezes TGI's defaults. The tokenizer is a fake: one token per char."""

import dataclasses
import json
import random
import re

import pytest

from tgi_router.errors import ValidationError, error_response
from tgi_router.request.protocol import GenerateRequest
from tgi_router.request.validation import DEFAULT_GENERATION_LENGTH, ValidationLimits, ValidGrammar, validate

LIMITS = ValidationLimits(max_input_tokens=10, max_total_tokens=20)


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def run(inputs="hello", limits=LIMITS, stream=False, tokenize=chars, **parameters):
    request = GenerateRequest.model_validate({"inputs": inputs, "parameters": parameters})
    return validate(request, tokenize, limits, stream=stream, rng=random.Random(0))


def rejects(message, **kw):
    with pytest.raises(ValidationError) as info:
        run(**kw)
    assert info.value.detail == message
    return info.value


# ------------------------------------------------------------------ limits

def test_limits_default_to_tgi_launcher_values():
    assert (LIMITS.max_best_of, LIMITS.max_stop_sequences, LIMITS.max_top_n_tokens) \
        == (2, 4, 5)
    assert LIMITS.disable_grammar_support is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        LIMITS.max_best_of = 3


# ---------------------------------------------------------------- defaults

def test_defaults_are_tgis_neutral_values():
    v = run()
    p = v.parameters
    assert (p.temperature, p.top_k, p.top_p, p.typical_p) == (1.0, 0, 1.0, 1.0)
    assert (p.repetition_penalty, p.frequency_penalty) == (1.0, 0.0)
    assert p.do_sample is False and p.watermark is False and p.grammar is None
    assert v.top_n_tokens == 0 and v.best_of == 1 and v.adapter_id is None
    assert v.stopping.stop_sequences == () and v.stopping.ignore_eos_token is False
    assert v.details is False and v.decoder_input_details is False
    assert v.return_full_text is None


def test_request_is_frozen_with_ids_as_a_tuple():
    v = run("abc")
    assert v.input_ids == (97, 98, 99) and v.input_length == 3 and v.inputs == "abc"
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.input_length = 4


def test_absent_parameters_mean_sampling_as_in_tgi():
    request = GenerateRequest.model_validate({"inputs": "hi"})
    assert validate(request, chars, LIMITS).parameters.do_sample is True


def test_flags_and_adapter_pass_through():
    limits = ValidationLimits(max_input_tokens=10, max_total_tokens=20, adapters=("x", "a"), model_id="org/base")
    v = run(limits=limits, details=True, return_full_text=True, adapter_id="a", watermark=True,
            decoder_input_details=True, top_n_tokens=5, stop=["x", "y"])
    assert v.details and v.decoder_input_details and v.return_full_text
    assert (v.adapter_id, v.adapter) == ("a", 2) and v.parameters.watermark and v.top_n_tokens == 5
    assert v.stopping.stop_sequences == ("x", "y")
    for base in (None, "", "org/base"):  # no adapter, or the base model's own id
        got = run(limits=limits, adapter_id=base)
        assert (got.adapter_id, got.adapter) == (None, 0)


@pytest.mark.parametrize("adapters,listed", [(("x", "a"), "x, a"), ((), "none (--lora-adapters)")])
def test_an_unknown_adapter_is_refused_naming_the_loaded_ones(adapters, listed):
    limits = ValidationLimits(max_input_tokens=10, max_total_tokens=20, adapters=adapters)
    with pytest.raises(ValidationError, match=re.escape(f"adapter 'b' is not loaded; loaded adapters: {listed}")):
        run(limits=limits, adapter_id="b")


# ------------------------------------------------------------------- seeds

def test_seed_is_drawn_at_random_when_absent():
    request = GenerateRequest.model_validate({"inputs": "hi", "parameters": {}})
    seeds = {validate(request, chars, LIMITS).parameters.seed for _ in range(4)}
    assert len(seeds) == 4 and all(0 <= s < 2**64 for s in seeds)


def test_seed_draw_uses_the_given_rng():
    assert run().parameters.seed == random.Random(0).getrandbits(64)


def test_given_seed_is_kept():
    assert run(seed=42).parameters.seed == 42


# --------------------------------------------------------------- do_sample

@pytest.mark.parametrize("given, sampled", [
    ({}, False), ({"do_sample": True}, True), ({"temperature": 0.5}, True),
    ({"temperature": 1.0}, False), ({"top_k": 5}, True), ({"top_p": 0.9}, True),
    ({"typical_p": 0.9}, True), ({"repetition_penalty": 1.2}, False),
])
def test_sampling_follows_tgi_shards_rule(given, sampled):
    assert run(**given).parameters.do_sample is sampled


# ---------------------------------------------------------- sampling rules

@pytest.mark.parametrize("value", [0.0, -1.0])
def test_temperature_must_be_positive(value):
    rejects("`temperature` must be strictly positive", temperature=value)


@pytest.mark.parametrize("value", [0.0, -0.5])
def test_repetition_penalty_must_be_positive(value):
    rejects("`repetition_penalty` must be strictly positive", repetition_penalty=value)


@pytest.mark.parametrize("value", [-2.5, 2.01, 1e39])
def test_frequency_penalty_must_be_within_two(value):
    rejects("`frequency_penalty` must be >= -2.0 and <= 2.0", frequency_penalty=value)


def test_frequency_penalty_bounds_are_inclusive():
    assert run(frequency_penalty=-2.0).parameters.frequency_penalty == -2.0
    assert run(frequency_penalty=2.0).parameters.frequency_penalty == 2.0


@pytest.mark.parametrize("value", [0.0, 1.0, 1.5, -0.1, 0.99999999999])
def test_top_p_must_be_strictly_between_0_and_1(value):
    rejects("`top_p` must be > 0.0 and < 1.0", top_p=value)


@pytest.mark.parametrize("value", [0.0, 1.0, 2.0])
def test_typical_p_must_be_strictly_between_0_and_1(value):
    rejects("`typical_p` must be > 0.0 and < 1.0", typical_p=value)


@pytest.mark.parametrize("value", [0, -3])
def test_top_k_must_be_positive(value):
    rejects("`top_k` must be strictly positive", top_k=value)


def test_valid_sampling_values_are_kept():
    p = run(temperature=0.5, top_k=40, top_p=0.5, typical_p=0.25,
            repetition_penalty=1.5, frequency_penalty=-1.0).parameters
    assert (p.temperature, p.top_k, p.top_p, p.typical_p) == (0.5, 40, 0.5, 0.25)
    assert (p.repetition_penalty, p.frequency_penalty) == (1.5, -1.0)


# --------------------------------------------------------------- counts

def test_max_new_tokens_must_be_positive():
    rejects("`max_new_tokens` must be strictly positive", max_new_tokens=0)


def test_stop_sequences_are_limited():
    rejects("`stop` supports up to 4 stop sequences. Given: 5", stop=list("abcde"))
    assert len(run(stop=list("abcd")).stopping.stop_sequences) == 4


def test_top_n_tokens_are_limited():
    rejects("`top_n_tokens` must be >= 0 and <= 5. Given: 6", top_n_tokens=6)
    assert run(top_n_tokens=0).top_n_tokens == 0


def test_limits_appear_in_messages():
    limits = dataclasses.replace(LIMITS, max_stop_sequences=1, max_top_n_tokens=2)
    rejects("`stop` supports up to 1 stop sequences. Given: 2", stop=["a", "b"],
            limits=limits)
    rejects("`top_n_tokens` must be >= 0 and <= 2. Given: 3", top_n_tokens=3,
            limits=limits)


# ---------------------------------------------------------------- best_of

def test_best_of_above_the_limit():
    rejects("`best_of` must be > 0 and <= 2. Given: 3", best_of=3, do_sample=True)


def test_best_of_disabled_when_the_limit_is_one():
    rejects("`best_of` != 1 is not allowed for this endpoint", best_of=2,
            do_sample=True, limits=dataclasses.replace(LIMITS, max_best_of=1))
    assert run(best_of=1, limits=dataclasses.replace(LIMITS, max_best_of=1)).best_of == 1


def test_best_of_requires_sampling():
    rejects("you must use sampling when `best_of` is > 1", best_of=2)


def test_best_of_counts_any_warper_as_sampling():
    assert run(best_of=2, temperature=1.0).best_of == 2


def test_best_of_forbids_a_seed():
    rejects("`seed` must not be set when `best_of` > 1", best_of=2, do_sample=True, seed=1)


def test_best_of_within_limits_is_kept():
    v = run(best_of=2, do_sample=True)
    assert v.best_of == 2 and v.parameters.do_sample


def test_best_of_zero_or_one_runs_one_sequence_as_tgi():
    assert run(best_of=0).best_of == 1
    assert run(best_of=1, seed=3).parameters.seed == 3


def test_best_of_limit_is_checked_before_sampling_rules():
    rejects("`best_of` must be > 0 and <= 2. Given: 3", best_of=3, temperature=-1.0)


# ----------------------------------------------------------------- stream

@pytest.mark.parametrize("best_of", [0, 2])
def test_stream_refuses_best_of_other_than_one(best_of):
    rejects("`best_of` != 1 is not supported when streaming tokens", best_of=best_of,
            do_sample=True, stream=True)


def test_stream_refuses_decoder_input_details():
    rejects("`decoder_input_details` == true is not supported when streaming tokens",
            decoder_input_details=True, stream=True)


def test_stream_accepts_best_of_one():
    assert run(best_of=1, stream=True).best_of == 1


# ------------------------------------------------------------------ inputs

def test_inputs_cannot_be_empty():
    err = rejects("`inputs` cannot be empty", inputs="")
    assert error_response(err) == (422, {
        "error": "Input validation error: `inputs` cannot be empty",
        "error_type": "validation"})


def test_whitespace_inputs_are_not_empty():
    assert run(inputs=" ").input_length == 1


@pytest.mark.parametrize("value", [0, 11])
def test_truncate_must_be_positive_and_at_most_max_input_tokens(value):
    rejects(f"`truncate` must be strictly positive and less than 10. Given: {value}",
            truncate=value)


def test_truncate_keeps_the_last_tokens():
    v = run(inputs="abcdefghijklmnop", truncate=3, max_new_tokens=5)
    assert v.input_ids == tuple(chars("nop")) and v.input_length == 3 and v.truncate == 3


def test_truncate_longer_than_the_input_keeps_all_of_it():
    v = run(inputs="abc", truncate=10)
    assert v.input_ids == tuple(chars("abc")) and v.truncate == 10


def test_truncate_defaults_to_max_input_tokens():
    assert run().truncate == 10


def test_total_tokens_are_limited():
    rejects("`inputs` tokens + `max_new_tokens` must be <= 20. "
            "Given: 5 `inputs` tokens and 16 `max_new_tokens`", max_new_tokens=16)
    assert run(max_new_tokens=15).stopping.max_new_tokens == 15


def test_input_tokens_are_limited():
    rejects("`inputs` must have less than 10 tokens. Given: 11", inputs="a" * 11,
            max_new_tokens=1)
    assert run(inputs="a" * 10, max_new_tokens=1).input_length == 10


def test_total_is_checked_before_input_length_as_tgi():
    rejects("`inputs` tokens + `max_new_tokens` must be <= 20. "
            "Given: 15 `inputs` tokens and 10 `max_new_tokens`",
            inputs="a" * 15, max_new_tokens=10)


def test_inputs_beyond_the_context_without_max_new_tokens_report_the_total():
    rejects("`inputs` tokens + `max_new_tokens` must be <= 20. "
            "Given: 25 `inputs` tokens and 0 `max_new_tokens`", inputs="a" * 25)


def test_tokenizer_failure_is_a_validation_error():
    def broken(text):
        raise RuntimeError("boom")
    rejects("tokenizer error boom", tokenize=broken)


# --------------------------------------------------------- max_new_tokens

def test_max_new_tokens_defaults_to_the_rest_of_the_context():
    s = run(inputs="abcde").stopping
    assert s.max_new_tokens == 15 and s.max_total_new_tokens == 15


def test_default_max_new_tokens_is_scheduled_by_chunks_of_1024():
    limits = ValidationLimits(max_input_tokens=100, max_total_tokens=4096)
    s = run(inputs="abcd", limits=limits).stopping
    assert s.max_new_tokens == DEFAULT_GENERATION_LENGTH == 1024
    assert s.max_total_new_tokens == 4092


def test_given_max_new_tokens_is_both_limits():
    s = run(max_new_tokens=7).stopping
    assert s.max_new_tokens == 7 and s.max_total_new_tokens == 7


# ----------------------------------------------------------------- grammar

PROPS = {"properties": {"name": {"type": "string"}}}


def test_regex_grammar_passes_through():
    g = run(grammar={"type": "regex", "value": "[a-z]+"}).parameters.grammar
    assert isinstance(g, ValidGrammar) and g.type == "regex" and g.source == "[a-z]+"
    assert json.loads(g.text)["grammars"]  # llguidance's grammar text for the shards


@pytest.mark.parametrize("value", [PROPS, json.dumps(PROPS)])
def test_json_grammar_as_object_or_string(value):
    g = run(grammar={"type": "json", "value": value}).parameters.grammar
    assert g.type == "json" and json.loads(g.source) == PROPS


def test_json_schema_grammar_uses_its_schema():
    g = run(grammar={"type": "json_schema",
                     "value": {"name": "n", "schema": PROPS}}).parameters.grammar
    assert g.type == "json" and json.loads(g.source) == PROPS


@pytest.mark.parametrize("grammar, message", [
    ({"type": "regex", "value": "(a"}, "unclosed group"),
    ({"type": "regex", "value": "a{5,2}"}, "grammar is not valid"),
    ({"type": "json", "value": {"properties": {"a": {"type": "strin"}}}}, "strin"),
    ({"type": "json", "value": {"properties": {"a": {"$ref": "#/$defs/missing"}}}}, "missing"),
])
def test_grammar_that_does_not_compile_is_a_validation_error(grammar, message):
    with pytest.raises(ValidationError) as info:
        run(grammar=grammar)
    assert info.value.detail.startswith("grammar is not valid: ") and message in info.value.detail


def test_grammar_disabled():
    rejects("grammar is not supported", grammar={"type": "regex", "value": "a"},
            limits=dataclasses.replace(LIMITS, disable_grammar_support=True))


@pytest.mark.parametrize("value", [1, [PROPS], None])
def test_json_grammar_value_must_be_an_object_or_a_string(value):
    rejects("grammar is not supported", grammar={"type": "json", "value": value})


@pytest.mark.parametrize("grammar", [
    {"type": "json", "value": {"type": "object"}},
    {"type": "json", "value": "{}"},
    {"type": "json", "value": "true"},
    {"type": "json_schema", "value": {"schema": {"type": "object"}}},
])
def test_json_schema_must_have_properties(grammar):
    rejects("grammar is not valid: Grammar must have a 'properties' field", grammar=grammar)


def test_json_grammar_string_must_be_json():
    with pytest.raises(ValidationError) as info:
        run(grammar={"type": "json", "value": "{not json"})
    assert info.value.detail.startswith("grammar is not valid: ")


def test_json_schema_must_be_an_object_or_a_boolean():
    with pytest.raises(ValidationError) as info:
        run(grammar={"type": "json", "value": "[1]"})
    assert info.value.detail.startswith("grammar is not valid: ")


# ------------------------------------------------------------------- order

def test_rules_fire_in_tgi_order():
    everything_wrong = dict(best_of=3, temperature=-1.0, repetition_penalty=0.0,
                            frequency_penalty=3.0, top_p=2.0, typical_p=2.0, top_k=0,
                            max_new_tokens=0, stop=list("abcde"), seed=1,
                            top_n_tokens=9, truncate=0, inputs="", do_sample=True)
    order = [
        ("best_of", "`best_of` must be > 0 and <= 2. Given: 3"),
        ("temperature", "`temperature` must be strictly positive"),
        ("repetition_penalty", "`repetition_penalty` must be strictly positive"),
        ("frequency_penalty", "`frequency_penalty` must be >= -2.0 and <= 2.0"),
        ("top_p", "`top_p` must be > 0.0 and < 1.0"),
        ("typical_p", "`typical_p` must be > 0.0 and < 1.0"),
        ("top_k", "`top_k` must be strictly positive"),
        ("max_new_tokens", "`max_new_tokens` must be strictly positive"),
        ("stop", "`stop` supports up to 4 stop sequences. Given: 5"),
        ("seed", "`seed` must not be set when `best_of` > 1"),
        ("top_n_tokens", "`top_n_tokens` must be >= 0 and <= 5. Given: 9"),
        ("inputs", "`inputs` cannot be empty"),
        ("truncate", "`truncate` must be strictly positive and less than 10. Given: 0"),
    ]
    for name, message in order:
        rejects(message, **everything_wrong)
        everything_wrong.pop(name)
        if name == "best_of":
            everything_wrong["best_of"] = 2  # kept valid, to meet the seed rule
    assert run(**everything_wrong).best_of == 2
