"""The wire schemas parse and write JSON exactly as TGI does, and errors map
to TGI's status and body."""

import json
import math
import subprocess
import sys

import pydantic
import pytest

from tgi_router import errors
from tgi_router.app import is_json
from tgi_router.request.protocol import (
    U32_MAX,
    U64_MAX,
    ChatTokenizeResponse,
    CompatGenerateRequest,
    Details,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    Info,
    JsonGrammar,
    JsonSchemaGrammar,
    PrefillToken,
    RegexGrammar,
    StreamResponse,
    Token,
    TokenizeResponse,
)


def params(**kw):
    return GenerateRequest.model_validate({"inputs": "x", "parameters": kw}).parameters


def round_trip(model, payload):
    assert json.loads(model.model_validate(payload).model_dump_json()) == payload


# ---------------------------------------------------------------- requests

def test_absent_parameters_sample_like_tgi_default_parameters():
    assert GenerateRequest.model_validate({"inputs": "x"}).parameters.do_sample is True


def test_empty_parameters_object_is_greedy_with_serde_defaults():
    p = params()
    assert p.do_sample is False
    assert p.max_new_tokens is None and p.best_of is None and p.seed is None
    assert p.stop == [] and p.details is False and p.decoder_input_details is False
    assert p.watermark is False and p.return_full_text is None and p.grammar is None
    assert p.adapter_id is None and p.top_n_tokens is None and p.truncate is None


def test_every_tgi_parameter_is_read():
    p = params(best_of=2, decoder_input_details=True, details=True, do_sample=True,
               frequency_penalty=0.5, grammar={"type": "regex", "value": "a+"},
               max_new_tokens=20, repetition_penalty=1.25, return_full_text=False,
               seed=7, stop=["\n"], temperature=0.5, top_k=10, top_n_tokens=3,
               top_p=0.5, truncate=8, typical_p=0.5, watermark=True, adapter_id="lora")
    assert (p.best_of, p.max_new_tokens, p.seed, p.top_k, p.top_n_tokens, p.truncate) \
        == (2, 20, 7, 10, 3, 8)
    assert (p.temperature, p.top_p, p.typical_p, p.frequency_penalty,
            p.repetition_penalty) == (0.5, 0.5, 0.5, 0.5, 1.25)
    assert p.stop == ["\n"] and p.adapter_id == "lora" and p.grammar.value == "a+"
    assert p.details and p.decoder_input_details and p.do_sample and p.watermark


def test_unknown_fields_are_ignored_as_serde_does():
    req = GenerateRequest.model_validate(
        {"inputs": "x", "stream": True, "parameters": {"max_tokens": 3, "n": 2}})
    assert req.parameters.max_new_tokens is None


def test_explicit_null_is_accepted_for_options():
    assert params(max_new_tokens=None, temperature=None, seed=None).seed is None


@pytest.mark.parametrize("payload", [
    {"inputs": None}, {}, {"inputs": 1}, {"inputs": "x", "parameters": None},
    {"inputs": "x", "parameters": {"do_sample": None}},
    {"inputs": "x", "parameters": {"stop": None}},
    {"inputs": "x", "parameters": {"details": "true"}},
    {"inputs": "x", "parameters": {"max_new_tokens": "5"}},
    {"inputs": "x", "parameters": {"max_new_tokens": 5.0}},
    {"inputs": "x", "parameters": {"max_new_tokens": -1}},
    {"inputs": "x", "parameters": {"max_new_tokens": U32_MAX + 1}},
    {"inputs": "x", "parameters": {"seed": -1}},
    {"inputs": "x", "parameters": {"seed": U64_MAX + 1}},
    {"inputs": "x", "parameters": {"top_k": 2**31}},
    {"inputs": "x", "parameters": {"temperature": "0.5"}},
    {"inputs": "x", "parameters": {"stop": "\n"}},
])
def test_wrong_json_types_are_rejected_as_serde_does(payload):
    with pytest.raises(pydantic.ValidationError):
        GenerateRequest.model_validate(payload)


def test_integer_is_accepted_for_a_float():
    assert params(temperature=1).temperature == 1.0


def test_widths_match_rust_types():
    assert params(seed=U64_MAX).seed == U64_MAX
    assert params(top_k=-(2**31)).top_k == -(2**31)
    assert params(max_new_tokens=U32_MAX).max_new_tokens == U32_MAX


def test_floats_are_rounded_to_f32_as_tgi_parses_them():
    assert params(top_p=0.99999999999).top_p == 1.0
    assert params(temperature=0.1).temperature == pytest.approx(0.1, abs=1e-8)
    assert params(temperature=0.1).temperature != 0.1
    assert params(temperature=1e39).temperature == math.inf


def test_nan_cannot_be_sent():
    with pytest.raises(pydantic.ValidationError):
        GenerateRequest.model_validate({"inputs": "x", "parameters": {"top_p": math.nan}})


def test_grammar_json_with_object_or_string_value():
    g = params(grammar={"type": "json", "value": {"properties": {}}}).grammar
    assert isinstance(g, JsonGrammar) and g.value == {"properties": {}}
    g = params(grammar={"type": "json", "value": '{"properties": {}}'}).grammar
    assert g.value == '{"properties": {}}'


def test_grammar_json_object_is_an_alias_of_json():
    assert params(grammar={"type": "json_object", "value": {}}).grammar.type == "json"


def test_grammar_regex():
    g = params(grammar={"type": "regex", "value": "[0-9]+"}).grammar
    assert isinstance(g, RegexGrammar) and g.value == "[0-9]+"


def test_grammar_json_schema_takes_name_and_schema_and_ignores_strict():
    g = params(grammar={"type": "json_schema", "value": {
        "name": "n", "strict": True, "schema": {"properties": {"a": {}}}}}).grammar
    assert isinstance(g, JsonSchemaGrammar)
    assert g.value.name == "n" and g.value.schema_ == {"properties": {"a": {}}}
    nameless = params(grammar={"type": "json_schema", "value": {"schema": {}}}).grammar
    assert nameless.value.name is None


@pytest.mark.parametrize("grammar", [
    {"type": "ebnf", "value": "x"}, {"type": "regex"}, {"type": "regex", "value": 1},
    {"type": "json_schema", "value": {"name": "n"}}, {"value": "x"},
])
def test_bad_grammar_is_rejected(grammar):
    with pytest.raises(pydantic.ValidationError):
        params(grammar=grammar)


def test_compat_request_reads_stream_and_converts():
    req = CompatGenerateRequest.model_validate({"inputs": "x", "stream": True})
    assert req.stream is True and req.parameters.do_sample is True
    assert CompatGenerateRequest.model_validate({"inputs": "x"}).stream is False
    gen = req.to_generate_request()
    assert isinstance(gen, GenerateRequest) and gen.inputs == "x"
    assert gen.parameters == req.parameters


# --------------------------------------------------------------- responses

TOKENS = [{"id": 1683, "text": " Deep", "logprob": -1.5, "special": False},
          {"id": 2, "text": "</s>", "logprob": -0.25, "special": True}]
PREFILL = [{"id": 1, "text": "<s>", "logprob": None},
           {"id": 1724, "text": "What", "logprob": -10.5}]


def test_generate_response_with_details_and_prefill_round_trips():
    round_trip(GenerateResponse, {"generated_text": " Deep", "details": {
        "finish_reason": "eos_token", "generated_tokens": 2, "seed": None,
        "prefill": PREFILL, "tokens": TOKENS}})


def test_generate_response_without_details_omits_the_key():
    assert GenerateResponse(generated_text="hi").model_dump() == {"generated_text": "hi"}
    round_trip(GenerateResponse, {"generated_text": "hi"})


def test_details_with_best_of_sequences_and_top_tokens_round_trips():
    top = [[TOKENS[0], TOKENS[1]], [TOKENS[1]]]
    round_trip(GenerateResponse, {"generated_text": "a", "details": {
        "finish_reason": "length", "generated_tokens": 2, "seed": 42,
        "prefill": [], "tokens": TOKENS,
        "best_of_sequences": [{"generated_text": "b", "finish_reason": "stop_sequence",
                               "generated_tokens": 2, "seed": 43, "prefill": [],
                               "tokens": TOKENS, "top_tokens": top}],
        "top_tokens": top}})


def test_details_omit_absent_best_of_and_empty_top_tokens_but_keep_null_seed():
    d = Details(finish_reason="length", generated_tokens=0, seed=None,
                prefill=[], tokens=[])
    assert d.model_dump() == {"finish_reason": "length", "generated_tokens": 0,
                              "seed": None, "prefill": [], "tokens": []}


def test_best_of_sequence_omits_empty_top_tokens():
    seq = {"generated_text": "b", "finish_reason": "length", "generated_tokens": 1,
           "seed": None, "prefill": [], "tokens": TOKENS[:1]}
    round_trip(GenerateResponse, {"generated_text": "a", "details": {
        "finish_reason": "length", "generated_tokens": 1, "seed": 1, "prefill": [],
        "tokens": TOKENS[:1], "best_of_sequences": [seq]}})


def test_non_finite_logprob_is_written_as_null():
    assert PrefillToken(id=1, text="a", logprob=math.nan).model_dump()["logprob"] is None
    token = Token(id=1, text="a", logprob=-math.inf, special=False)
    assert json.loads(token.model_dump_json())["logprob"] is None


def test_finish_reason_is_one_of_tgis():
    with pytest.raises(pydantic.ValidationError):
        Details(finish_reason="stop", generated_tokens=0, seed=None, prefill=[], tokens=[])


def test_intermediate_stream_event_keeps_nulls_and_omits_empty_top_tokens():
    event = StreamResponse(index=1, token=Token(**TOKENS[0]))
    assert json.loads(event.model_dump_json()) == {
        "index": 1, "token": TOKENS[0], "generated_text": None, "details": None}


def test_last_stream_event_round_trips():
    round_trip(StreamResponse, {
        "index": 2, "token": TOKENS[1], "top_tokens": [TOKENS[0]],
        "generated_text": " Deep", "details": {"finish_reason": "eos_token",
                                               "generated_tokens": 2, "seed": None,
                                               "input_length": 5}})


def test_error_response_round_trips():
    round_trip(ErrorResponse, {"error": "Model is overloaded", "error_type": "overloaded"})


def test_info_writes_tgi3_fields_with_nulls():
    info = {"model_id": "HuggingFaceTB/SmolLM2-135M-Instruct", "model_sha": None,
            "model_pipeline_tag": "text-generation", "max_concurrent_requests": 128,
            "max_best_of": 2, "max_stop_sequences": 4, "max_input_tokens": 1024,
            "max_total_tokens": 2048, "validation_workers": 2,
            "max_client_batch_size": 4, "router": "text-generation-router",
            "version": "3.3.6", "sha": None, "docker_label": None}
    round_trip(Info, info)
    assert list(json.loads(Info.model_validate(info).model_dump_json())) == list(info)


def test_tokenize_response_is_a_bare_list():
    round_trip(TokenizeResponse, [{"id": 1, "text": "<s>", "start": 0, "stop": 0},
                                  {"id": 22557, "text": "Hello", "start": 0, "stop": 5}])


def test_chat_tokenize_response_round_trips():
    round_trip(ChatTokenizeResponse, {
        "tokenize_response": [{"id": 1, "text": "Hi", "start": 0, "stop": 2}],
        "templated_text": "Hi"})


# ------------------------------------------------------------------ errors

@pytest.mark.parametrize("err, status, body", [
    (errors.ValidationError("`temperature` must be strictly positive"), 422,
     {"error": "Input validation error: `temperature` must be strictly positive",
      "error_type": "validation"}),
    (errors.OverloadedError(), 429,
     {"error": "Model is overloaded", "error_type": "overloaded"}),
    (errors.GenerationError("CUDA out of memory"), 424,
     {"error": "Request failed during generation: CUDA out of memory",
      "error_type": "generation"}),
    (errors.TemplateError("template not found"), 422,
     {"error": "Template error: template not found", "error_type": "template_error"}),
    (errors.ToolError("bad"), 422, {"error": "Tool error: bad", "error_type": "tool_error"}),
    (errors.UnhealthyError(), 503, {"error": "unhealthy", "error_type": "healthcheck"}),
])
def test_errors_map_to_tgi_status_and_json_body(err, status, body):
    assert err.tgi_body == "json"
    assert errors.error_response(err) == (status, body)
    ErrorResponse.model_validate(body)


def test_errors_tgi_answers_without_json_keep_tgi_status_and_text():
    assert errors.error_response(errors.UnauthorizedError())[0] == 401
    assert errors.UnauthorizedError.tgi_body == "empty"
    status, body = errors.error_response(errors.PayloadTooLargeError())
    assert status == 413 and errors.PayloadTooLargeError.tgi_body == "text"
    assert body["error"] == "Failed to buffer the request body: length limit exceeded"
    status, body = errors.error_response(errors.BodyDeserializeError("inputs: missing"))
    assert status == 422
    assert body["error"] == ("Failed to deserialize the JSON body into the target type: "
                             "inputs: missing")
    assert errors.error_response(errors.BodySyntaxError("eof"))[0] == 400
    status, body = errors.error_response(errors.MissingJsonContentTypeError())
    assert status == 415
    assert body["error"] == "Expected request with `Content-Type: application/json`"


@pytest.mark.parametrize("content_type, json_", [
    ("application/json", True), ("Application/JSON; charset=utf-8", True), ("application/vnd.api+json", True),
    ("", False), ("text/plain", False), ("text/json", False), ("application/x-www-form-urlencoded", False),
    ("application/jsonl", False)])
def test_a_json_content_type_is_what_tgi_accepts(content_type, json_):
    assert is_json(content_type) is json_


def test_importing_the_schemas_does_not_import_torch():
    code = ("import sys; import tgi_router.request.protocol, tgi_router.request.validation, "
            "tgi_router.errors; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("text", ["", " Deep", 'q " \\ \n\t\x00', "caf\u00e9 \U0001f600"])
@pytest.mark.parametrize("logprob", [-0.25, -1e-05, -123.456789, 0.0, float("-inf"), float("nan")])
@pytest.mark.parametrize("special", [False, True])
def test_fast_stream_token_event_is_what_the_model_writes(text, logprob, special):
    """A streamed token's event is built without models: the same JSON
    (floats the same value, where the spelling may differ) as StreamResponse's."""
    from tgi_router.scheduling.request_stream import StreamEvent, TokenOut
    from tgi_router.tgi_api.responses import stream_response, stream_token_event

    event = StreamEvent(TokenOut(7, text, logprob, special), [])
    fast = stream_token_event(event, 3)
    assert fast.startswith(b"data:") and fast.endswith(b"\n\n")
    assert json.loads(fast[5:]) == json.loads(stream_response(None, event, 3).model_dump_json())
    tops = [TokenOut(1, "a", -1.0, False)]
    assert stream_token_event(StreamEvent(TokenOut(7, text, logprob, special), tops), 3) is None
