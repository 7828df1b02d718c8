"""OpenAI requests become validated generation requests: sampling fields
mapped onto TGI's, the chat template applied and tokenized as the template
wrote it, tools and response_format turned into grammars, `n` choices as `n`
requests with reproducible seeds. The tokenizer is a real byte-level BPE
(one token per UTF-8 byte, <s>=256 added in front by its post-processor)."""

import json

import pytest
from tokenizers import processors

from tgi_router.errors import TemplateError, TGIError, ToolError, ValidationError
from tgi_router.openai_compat.chat_template import DEFAULT_TOOL_PROMPT, ChatTemplate
from tgi_router.openai_compat.prepare import MAX_CHOICES, PreparedChat, prepare_chat, prepare_completion
from tgi_router.openai_compat.protocol import ChatCompletionRequest, CompletionRequest
from tgi_router.request.validation import ValidationLimits
from tgi_router.text.grammar import closed_schema, json_grammar
from tgi_router.text.tokenizer import RouterTokenizer

from .conftest import BOS, EOS, byte_level_tokenizer

PLAIN_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOOLS_TEMPLATE = ("{{ bos_token }}{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
                  "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")
LIMITS = ValidationLimits(max_input_tokens=4000, max_total_tokens=8000)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HELLO = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def tokenizer() -> RouterTokenizer:
    tok = byte_level_tokenizer()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    config = {"chat_template": PLAIN_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>",
              "all_special_ids": [BOS, EOS]}
    return RouterTokenizer(tok.to_str(), json.dumps(config))


@pytest.fixture(scope="module")
def template(tokenizer) -> ChatTemplate:
    c = tokenizer.config
    return ChatTemplate(c.chat_template, c.bos_token, c.eos_token)


@pytest.fixture(scope="module")
def tools_template(tokenizer) -> ChatTemplate:
    return ChatTemplate(TOOLS_TEMPLATE, "<s>", "</s>")


@pytest.fixture
def chat(tokenizer, template):
    """chat(limits=..., template=..., **body) -> PreparedChat."""
    def run(limits=LIMITS, chat_template=None, **body) -> PreparedChat:
        body.setdefault("messages", HELLO)
        request = ChatCompletionRequest.model_validate(body)
        return prepare_chat(request, chat_template or template, tokenizer, limits)
    return run


@pytest.fixture
def completion(tokenizer):
    def run(limits=LIMITS, **body):
        body.setdefault("prompt", "Once upon")
        return prepare_completion(CompletionRequest.model_validate(body), tokenizer, limits)
    return run


def rejects(run, error=ValidationError, **body) -> TGIError:
    with pytest.raises(error) as info:
        run(**body)
    assert type(info.value) is error and info.value.status == 422
    return info.value


# --------------------------------------------------------------- the prompt

def test_chat_is_templated_and_tokenized_without_adding_special_tokens(chat, tokenizer):
    prepared = chat(messages=[{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Ça va?"}])
    assert prepared.templated_text == "<s><|system|>Be brief.\n<|user|>Ça va?\n<|assistant|>"
    [req] = prepared.requests
    assert req.inputs == prepared.templated_text
    # the template's own <s> and nothing more; é is two byte tokens
    assert req.input_ids[0] == BOS and req.input_ids.count(BOS) == 1
    assert list(req.input_ids) == tokenizer.encode(prepared.templated_text, add_special_tokens=False)
    assert req.input_length == len(prepared.templated_text.encode()) - len("<s>") + 1
    assert tokenizer.decode(list(req.input_ids), skip_special_tokens=False) == prepared.templated_text


def test_without_tools_nothing_is_planned(chat):
    prepared = chat()
    assert prepared.tools.tools is None and prepared.tools.grammar is None
    assert prepared.requests[0].parameters.grammar is None
    assert DEFAULT_TOOL_PROMPT not in prepared.templated_text


def test_a_failing_template_is_a_template_error(chat):
    broken = ChatTemplate("{{ raise_exception('no system role') }}", "<s>", "</s>")
    with pytest.raises(TemplateError) as info:  # the chat template's own subclass of it
        chat(chat_template=broken)
    err = info.value
    assert err.status == 422 and err.detail == "no system role" and err.error_type == "template_error"


def test_completion_prompts_get_the_tokenizers_special_tokens(completion, tokenizer):
    [req] = completion(prompt="Once upon")
    assert list(req.input_ids) == [BOS] + tokenizer.encode("Once upon", add_special_tokens=False)
    assert req.inputs == "Once upon"


# -------------------------------------------------------------- sampling

def test_temperature_zero_is_greedy(chat):
    p = chat(temperature=0.0).requests[0].parameters
    assert p.do_sample is False and p.temperature == 1.0


def test_no_temperature_samples_at_one(chat):
    p = chat().requests[0].parameters
    assert p.do_sample is True and p.temperature == 1.0


def test_a_temperature_is_carried(chat):
    p = chat(temperature=0.5).requests[0].parameters
    assert p.do_sample is True and p.temperature == 0.5


def test_negative_temperature_is_refused(chat):
    assert rejects(chat, temperature=-0.5).detail == "`temperature` must be strictly positive"


def test_top_p_one_is_off_and_below_one_is_carried(chat):
    assert chat(top_p=1.0).requests[0].parameters.top_p == 1.0
    assert chat(top_p=0.5).requests[0].parameters.top_p == 0.5
    assert chat(top_p=1.0, temperature=0.0).requests[0].parameters.do_sample is False


@pytest.mark.parametrize("top_p", [0.0, 1.5])
def test_top_p_outside_its_range_is_refused(chat, top_p):
    assert rejects(chat, top_p=top_p).detail == "`top_p` must be > 0.0 and <= 1.0"


@pytest.mark.parametrize("body, expected", [
    ({"max_completion_tokens": 7, "max_tokens": 9}, 7),
    ({"max_tokens": 9}, 9),
    ({"max_completion_tokens": 7}, 7),
])
def test_max_completion_tokens_wins_over_max_tokens(chat, body, expected):
    stopping = chat(**body).requests[0].stopping
    assert stopping.max_new_tokens == stopping.max_total_new_tokens == expected


def test_no_max_tokens_means_the_rest_of_the_context(chat):
    req = chat().requests[0]
    assert req.stopping.max_total_new_tokens == LIMITS.max_total_tokens - req.input_length


def test_zero_max_tokens_is_refused(chat):
    assert rejects(chat, max_tokens=0).detail == "`max_new_tokens` must be strictly positive"


def test_too_long_a_prompt_is_refused(chat):
    small = ValidationLimits(max_input_tokens=10, max_total_tokens=20)
    assert rejects(chat, limits=small, max_tokens=5).detail.startswith("`inputs` tokens + `max_new_tokens`")


@pytest.mark.parametrize("stop, expected", [
    ("END", ("END",)), (["a", "b"], ("a", "b")), ([], ()), (None, ()),
])
def test_stop_is_a_string_or_a_list(chat, stop, expected):
    assert chat(stop=stop).requests[0].stopping.stop_sequences == expected


def test_too_many_stop_sequences_are_refused(chat):
    assert rejects(chat, stop=list("abcde")).detail.startswith("`stop` supports up to 4")


@pytest.mark.parametrize("value", [-2.0, 0.5, 2.0])
def test_presence_penalty_is_carried(chat, value):
    assert all(r.parameters.presence_penalty == value for r in chat(presence_penalty=value, n=2).requests)


def test_no_presence_penalty_is_zero(chat):
    assert chat().requests[0].parameters.presence_penalty == 0.0


@pytest.mark.parametrize("value", [-2.5, 2.5])
def test_presence_penalty_outside_its_range_is_refused(chat, completion, value):
    message = "`presence_penalty` must be >= -2.0 and <= 2.0"
    assert rejects(chat, presence_penalty=value).detail == message
    assert rejects(completion, presence_penalty=value).detail == message


def test_frequency_penalty_is_carried_and_checked(chat):
    assert chat(frequency_penalty=0.5).requests[0].parameters.frequency_penalty == 0.5
    assert chat().requests[0].parameters.frequency_penalty == 0.0
    assert rejects(chat, frequency_penalty=3.0).detail == "`frequency_penalty` must be >= -2.0 and <= 2.0"


def test_logprobs_with_top_logprobs_asks_for_top_tokens(chat):
    req = chat(logprobs=True, top_logprobs=3).requests[0]
    assert req.top_n_tokens == 3 and req.details is True
    assert chat(logprobs=True).requests[0].top_n_tokens == 0
    assert chat().requests[0].top_n_tokens == 0


def test_top_logprobs_without_logprobs_is_refused(chat):
    assert rejects(chat, top_logprobs=2).detail == "`top_logprobs` requires `logprobs` to be true"
    assert rejects(chat, top_logprobs=2, logprobs=False).status == 422


def test_too_many_top_logprobs_are_refused(chat):
    assert rejects(chat, logprobs=True, top_logprobs=6).detail.startswith("`top_n_tokens` must be")


def test_the_seed_is_carried(chat):
    assert chat(seed=1234).requests[0].parameters.seed == 1234


def test_a_negative_seed_is_a_validation_error_not_a_pydantic_error(tokenizer, template):
    # The parser refuses it first; prepare_chat must still answer in TGI's terms.
    body = ChatCompletionRequest.model_validate({"messages": HELLO}).model_copy(update={"seed": -1})
    with pytest.raises(ValidationError) as info:
        prepare_chat(body, template, tokenizer, LIMITS)
    assert info.value.status == 422 and info.value.detail.startswith("seed:")
    assert "\n" not in info.value.detail


# ------------------------------------------------------------- n choices

def test_n_copies_with_reproducible_distinct_seeds(chat):
    first = chat(n=4, seed=42, max_tokens=5).requests
    again = chat(n=4, seed=42, max_tokens=5).requests
    seeds = [r.parameters.seed for r in first]
    assert len(first) == 4 and seeds[0] == 42
    assert len(set(seeds)) == 4 and all(0 <= s < 2**64 for s in seeds)
    assert seeds == [r.parameters.seed for r in again]
    assert seeds != [r.parameters.seed for r in chat(n=4, seed=43).requests]
    # the copies differ only by their seed
    base = first[0]
    for r in first[1:]:
        assert (r.inputs, r.input_ids, r.stopping) == (base.inputs, base.input_ids, base.stopping)
        assert {k: v for k, v in vars(r.parameters).items() if k != "seed"} == \
            {k: v for k, v in vars(base.parameters).items() if k != "seed"}


def test_n_copies_without_a_seed_still_differ(chat):
    seeds = [r.parameters.seed for r in chat(n=3).requests]
    assert len(set(seeds)) == 3


@pytest.mark.parametrize("n", [0, MAX_CHOICES + 1])
def test_n_out_of_range_is_refused(chat, completion, n):
    message = f"`n` must be >= 1 and <= {MAX_CHOICES}. Given: {n}"
    assert rejects(chat, n=n).detail == message
    assert rejects(completion, n=n).detail == message


def test_n_at_the_limit_is_served(chat):
    assert len(chat(n=MAX_CHOICES).requests) == MAX_CHOICES


# ------------------------------------------------------- response_format

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"},
                                           "b": {"type": "object", "properties": {"c": {}}}}}


def grammar_schema(prepared: PreparedChat) -> dict:
    grammars = {r.parameters.grammar for r in prepared.requests}
    assert len(grammars) == 1 and None not in grammars  # every copy, the same grammar
    [g] = grammars
    assert g.type == "json"
    return json.loads(g.source)


def test_response_format_text_is_no_grammar(chat):
    assert chat(response_format={"type": "text"}).requests[0].parameters.grammar is None


def test_response_format_json_object(chat):
    assert grammar_schema(chat(n=2, response_format={"type": "json_object"})) == {"type": "object"}


def test_response_format_json_schema_as_given(chat):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    assert grammar_schema(chat(n=3, response_format=fmt)) == SCHEMA
    fmt["json_schema"]["strict"] = False
    assert grammar_schema(chat(response_format=fmt)) == SCHEMA


def test_response_format_json_schema_strict_closes_the_schema(chat):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    schema = grammar_schema(chat(n=2, response_format=fmt))
    assert schema == closed_schema(SCHEMA)
    assert schema["additionalProperties"] is False
    assert schema["properties"]["b"]["additionalProperties"] is False


def test_response_format_json_schema_without_a_schema_is_any_object(chat):
    fmt = {"type": "json_schema", "json_schema": {"name": "x"}}
    assert grammar_schema(chat(response_format=fmt)) == {"type": "object"}


def test_response_format_json_with_an_object_or_a_string(chat):
    assert grammar_schema(chat(response_format={"type": "json", "value": SCHEMA})) == SCHEMA
    as_text = {"type": "json", "value": json.dumps(SCHEMA)}
    assert grammar_schema(chat(n=2, response_format=as_text)) == SCHEMA


@pytest.mark.parametrize("value", ["{not json", "[" * 100_000, "5"])
def test_response_format_json_with_a_string_that_is_no_schema(chat, value):
    err = rejects(chat, response_format={"type": "json", "value": value})
    assert err.detail.startswith("grammar is not valid: ") and "\n" not in err.detail


def test_response_format_regex(chat):
    prepared = chat(n=2, response_format={"type": "regex", "value": "[0-9]+"})
    grammars = {r.parameters.grammar for r in prepared.requests}
    [g] = grammars
    assert (g.type, g.source) == ("regex", "[0-9]+")


def test_a_broken_response_format_is_a_422(chat):
    assert rejects(chat, response_format={"type": "regex", "value": "[0-9"}).detail.startswith(
        "grammar is not valid: ")
    fmt = {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}
    assert rejects(chat, response_format=fmt).detail.startswith("grammar is not valid: ")


# ----------------------------------------------------------------- tools

def test_required_tools_set_a_grammar_and_reach_the_prompt(chat):
    prepared = chat(n=2, tools=[WEATHER], tool_choice="required")
    assert prepared.tools.tools is not None and prepared.tools.grammar is not None
    assert all(r.parameters.grammar == prepared.tools.grammar for r in prepared.requests)
    # a template that does not read `tools` gets them in the last message
    text = prepared.templated_text
    tools_json = json.dumps(prepared.tools.tools, ensure_ascii=False, separators=(",", ":"))
    assert f"<|user|>Hi!\n---\n{DEFAULT_TOOL_PROMPT}\n{tools_json}\n<|assistant|>" in text
    assert '"name":"get_weather"' in tools_json


def test_a_tool_prompt_replaces_the_default(chat):
    text = chat(tools=[WEATHER], tool_choice="required", tool_prompt="Call a tool.").templated_text
    assert "\n---\nCall a tool.\n[" in text and DEFAULT_TOOL_PROMPT not in text


def test_a_template_that_reads_tools_gets_them_itself(chat, tools_template):
    text = chat(chat_template=tools_template, tools=[WEATHER], tool_choice="auto").templated_text
    assert text.startswith("<s><tools>[") and "get_weather" in text
    assert DEFAULT_TOOL_PROMPT not in text and text.endswith("<|user|>Hi!\n<|assistant|>")


def test_auto_tools_set_a_lark_grammar(chat):
    for choice in ("auto", None):
        prepared = chat(tools=[WEATHER], tool_choice=choice)
        assert prepared.requests[0].parameters.grammar.type == "lark"


def test_tool_choice_none_hides_the_tools(chat):
    prepared = chat(tools=[WEATHER], tool_choice="none")
    assert prepared.requests[0].parameters.grammar is None
    assert "get_weather" not in prepared.templated_text


def test_a_named_tool_choice(chat):
    prepared = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(prepared.requests[0].parameters.grammar.source)["properties"]["name"] == \
        {"const": "get_weather"}
    err = rejects(chat, ToolError, tools=[WEATHER],
                  tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.detail == "Tool choice 'nope' not found in the tools"


@pytest.mark.parametrize("fmt", [{"type": "json_object"}, {"type": "regex", "value": "a"},
                                 {"type": "json", "value": SCHEMA}])
def test_tools_and_a_response_format_do_not_combine(chat, fmt):
    rejects(chat, ToolError, tools=[WEATHER], tool_choice="required", response_format=fmt)
    rejects(chat, ToolError, tools=[WEATHER], response_format=fmt)
    # tool_choice "none" leaves the response format alone
    assert chat(tools=[WEATHER], tool_choice="none", response_format=fmt).requests[0].parameters.grammar


def test_disabled_grammar_support_refuses_grammars(chat):
    off = ValidationLimits(max_input_tokens=4000, max_total_tokens=8000, disable_grammar_support=True)
    for body in ({"response_format": {"type": "json_object"}}, {"tools": [WEATHER], "tool_choice": "required"},
                 {"tools": [WEATHER]}):
        assert rejects(chat, limits=off, **body).detail == "grammar is not supported"
    assert chat(limits=off, tools=[WEATHER], tool_choice="none").requests[0].parameters.grammar is None
    assert chat(limits=off, response_format={"type": "text"}).requests[0].parameters.grammar is None


# ------------------------------------------------------------ completions

def test_completion_choices_are_prompt_major(completion):
    reqs = completion(prompt=["one", "two", "three"], n=2, seed=7, max_tokens=4)
    assert [r.inputs for r in reqs] == ["one", "one", "two", "two", "three", "three"]
    assert [r.parameters.seed for r in reqs[::2]] == [7, 7, 7]
    assert len({r.parameters.seed for r in reqs[:2]}) == 2
    assert all(r.stopping.max_new_tokens == 4 and r.parameters.grammar is None for r in reqs)


def test_completion_maps_sampling_fields(completion):
    [req] = completion(temperature=0.0, stop="\n", logprobs=2, presence_penalty=1.0, frequency_penalty=0.5)
    p = req.parameters
    assert p.do_sample is False and req.top_n_tokens == 2 and req.stopping.stop_sequences == ("\n",)
    assert (p.presence_penalty, p.frequency_penalty) == (1.0, 0.5)
    assert completion()[0].parameters.do_sample is True


def test_completion_refusals(completion):
    assert rejects(completion, prompt=[]).detail == "`prompt` cannot be empty"
    assert rejects(completion, prompt="").detail == "`inputs` cannot be empty"
    assert rejects(completion, suffix="end").detail == "`suffix` is not supported"
    assert rejects(completion, best_of=2).detail == "`best_of` is not supported; use `n`"
    assert rejects(completion, best_of=3, n=2).detail == "`best_of` is not supported; use `n`"
    assert len(completion(best_of=2, n=2)) == 2
    assert len(completion(best_of=1)) == 1


def test_grammar_helpers_agree_with_prepare(chat):
    # what prepare attaches is exactly the builder's grammar
    assert chat(response_format={"type": "json", "value": SCHEMA}).requests[0].parameters.grammar == \
        json_grammar(SCHEMA)
