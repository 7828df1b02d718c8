"""Chat templates render as transformers renders them (SmolLM2's real
template and a tool-aware one), tools reach a template or the last message
as TGI puts them, request messages become the dicts templates expect, and
every failure, hostile templates included, is a one-line TemplateError."""

import json
import subprocess
import sys

import pytest

from tgi_router import errors
from tgi_router.openai_compat.chat_template import (
    DEFAULT_TOOL_PROMPT,
    MAX_RENDER_CHARS,
    ChatTemplate,
    TemplateError,
    template_messages,
)
from tgi_router.openai_compat.protocol import ChatMessage

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

# A small template in the style of Qwen's: it reads `tools` and tool calls.
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool.function | tojson }}\n{% endfor %}</tools>\n{% endif %}"
    "{% for message in messages %}<|{{ message.role }}|>"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}<call>{{ call.function.name }} "
    "{{ call.function.arguments | tojson }}</call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")

CONVERSATIONS = {
    "system_and_user": [{"role": "system", "content": "You are terse."},
                        {"role": "user", "content": "Hi!"}],
    "user_only_gets_the_default_system": [{"role": "user", "content": "What is 2+2?"}],
    "multi_turn": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hello"},
                   {"role": "assistant", "content": "Hi, how can I help?"},
                   {"role": "user", "content": "Tell me a joke.\nA short one."}],
    "tool_role": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "{\"name\": \"get_weather\"}"},
                  {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "0"}],
    "unicode": [{"role": "user", "content": "Ça va? 日本語 🙂"}],
}


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2's transformers tokenizer (imports transformers: tests only)."""
    from tgi_server.weights.gguf import load_gguf_tokenizer
    from tgi_server.weights.resolve import default_model_path
    return load_gguf_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def smollm2_template(smollm2):
    return ChatTemplate(smollm2.chat_template, smollm2.bos_token, smollm2.eos_token)


def msgs(*dicts: dict) -> list[ChatMessage]:
    return [ChatMessage.model_validate(d) for d in dicts]


# -------------------------------------------------- parity with transformers


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_smollm2_renders_like_transformers(smollm2, smollm2_template, name):
    messages = CONVERSATIONS[name]
    ours = smollm2_template.render(template_messages(msgs(*messages), smollm2_template.supports_tools))
    assert ours == smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_without_generation_prompt_like_transformers(smollm2, smollm2_template):
    messages = CONVERSATIONS["multi_turn"]
    ours = smollm2_template.render(messages, add_generation_prompt=False)
    assert ours == smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not ours.endswith("<|im_start|>assistant\n")


def test_developer_role_renders_as_system(smollm2, smollm2_template):
    ours = smollm2_template.render(template_messages(
        msgs({"role": "developer", "content": "S"}, {"role": "user", "content": "U"}), False))
    assert ours == smollm2.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        tokenize=False, add_generation_prompt=True)


def test_tool_template_receives_tools_and_calls_like_transformers(smollm2):
    template = ChatTemplate(TOOL_TEMPLATE, bos_token=None, eos_token=None)
    assert template.supports_tools
    request = msgs({"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "0", "type": "function",
                        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                   {"role": "tool", "content": "21C", "tool_call_id": "0"})
    messages = template_messages(request, template.supports_tools)
    ours = template.render(messages, tools=[WEATHER])
    assert ours == smollm2.apply_chat_template(messages, tools=[WEATHER], chat_template=TOOL_TEMPLATE,
                                               tokenize=False, add_generation_prompt=True)
    assert "<tools>{\"name\": \"get_weather\"" in ours
    assert "<call>get_weather {\"city\": \"Paris\"}</call>" in ours
    assert DEFAULT_TOOL_PROMPT not in ours


def test_generation_blocks_render_their_body_like_transformers(smollm2):
    source = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
              "{{ m.content }}{% endgeneration %}{% else %}[{{ m.content }}]{% endif %}{% endfor %}")
    messages = CONVERSATIONS["multi_turn"]
    assert ChatTemplate(source, bos_token=None, eos_token=None).render(messages) == smollm2.apply_chat_template(
        messages, chat_template=source, tokenize=False)


def test_tojson_matches_transformers(smollm2):
    source = ("{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}|"
              "{{ messages[0] | tojson(separators=(',', ':'), sort_keys=true) }}")
    messages = [{"role": "user", "content": "<é & \"q\">"}]
    assert ChatTemplate(source, bos_token=None, eos_token=None).render(messages) == smollm2.apply_chat_template(
        messages, chat_template=source, tokenize=False)


# ----------------------------------------------------------- variables


def test_bos_and_eos_tokens_are_variables():
    template = ChatTemplate("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}", "<s>", "</s>")
    assert template.render([{"role": "user", "content": "x"}]) == "<s>x</s>"


def test_strftime_now_formats_the_current_time():
    rendered = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}", bos_token=None, eos_token=None).render([])
    assert len(rendered) == 10 and rendered[4] == "-"


def test_extra_kwargs_are_variables_but_cannot_replace_the_renders_own():
    template = ChatTemplate("{{ mode }}|{{ messages | length }}|{{ tools }}|{{ add_generation_prompt }}",
                            bos_token=None, eos_token=None)
    extra = {"mode": "think", "messages": [], "tools": ["x"], "add_generation_prompt": False}
    assert template.render([{"role": "user", "content": "x"}], extra=extra) == "think|1|None|True"


# ------------------------------------------------------ tools without support


def test_smollm2_does_not_support_tools(smollm2_template):
    assert not smollm2_template.supports_tools


def test_tools_are_appended_to_the_last_message_as_tgi_does(smollm2, smollm2_template):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Weather in Paris?"}]
    ours = smollm2_template.render(messages, tools=[WEATHER])
    tools_json = json.dumps([WEATHER], ensure_ascii=False, separators=(",", ":"))
    injected = [messages[0], {"role": "user", "content":
                              f"Weather in Paris?\n---\n{DEFAULT_TOOL_PROMPT}\n{tools_json}"}]
    assert ours == smollm2.apply_chat_template(injected, tokenize=False, add_generation_prompt=True)
    assert messages[1]["content"] == "Weather in Paris?"


def test_a_tool_prompt_replaces_the_default(smollm2_template):
    ours = smollm2_template.render([{"role": "user", "content": "Q"}], tools=[WEATHER], tool_prompt="Call one.")
    assert "Q\n---\nCall one.\n[{" in ours and DEFAULT_TOOL_PROMPT not in ours


def test_default_tool_prompt_asks_for_arguments_not_parameters():
    assert "{name: function name, arguments: dictionary" in DEFAULT_TOOL_PROMPT
    assert "parameters" not in DEFAULT_TOOL_PROMPT


# ------------------------------------------------------------------ errors


def test_no_template_fails_at_render():
    template = ChatTemplate(template=None, bos_token=None, eos_token=None)
    assert not template.supports_tools
    with pytest.raises(TemplateError, match="This model has no chat template"):
        template.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("source", ["{% if %}", "{% for m in messages %}", "{{ }}", "{% foo %}"])
def test_a_template_that_does_not_compile_fails_at_construction(source):
    with pytest.raises(TemplateError):
        ChatTemplate(source, bos_token=None, eos_token=None)


def test_raise_exception_gives_the_templates_message():
    source = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}"
    with pytest.raises(TemplateError) as info:
        ChatTemplate(source, bos_token=None, eos_token=None).render([{"role": "assistant", "content": "x"}])
    assert str(info.value) == "Conversation must start with user"


def test_template_error_is_the_routers_422():
    err = TemplateError("boom")
    assert isinstance(err, ValueError) and isinstance(err, errors.TemplateError)
    assert errors.error_response(err) == (422, {"error": "Template error: boom", "error_type": "template_error"})


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ joiner.__init__.__globals__['os'] }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ messages.append(1) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ range(10**9) | list }}",
    "{{ 'x' * 10**9 }}",
    "{{ [0] * 10**9 }}",
    "{{ 2 ** (10**9) }}",
    "{{ lipsum(10**6) }}",
    "{% for i in range(99999) %}{{ 'y' * 1000 }}{% endfor %}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
])
def test_hostile_templates_fail_with_a_template_error(source):
    with pytest.raises(TemplateError) as info:
        ChatTemplate(source, bos_token=None, eos_token=None).render([{"role": "user", "content": "x"}])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("source", [
    "{{ undefined_thing.attr }}",
    "{{ messages[0].content + 1 }}",
    "{{ 1 / 0 }}",
    "{{ messages[5]['content'] | upper + 'x' }}",
    "{{ nothing | tojson }}",
])
def test_render_errors_are_one_line_template_errors(source):
    with pytest.raises(TemplateError) as info:
        ChatTemplate(source, bos_token=None, eos_token=None).render([{"role": "user", "content": "x"}])
    assert str(info.value) and "\n" not in str(info.value)


def test_output_is_bounded():
    source = "{% for i in range(20000) %}{{ messages[0].content }}{% endfor %}"
    big = "z" * (MAX_RENDER_CHARS // 10000)
    with pytest.raises(TemplateError, match="rendered prompt"):
        ChatTemplate(source, bos_token=None, eos_token=None).render([{"role": "user", "content": big}])


# ------------------------------------------------------ template_messages


def test_text_parts_join_into_one_string():
    [message] = template_messages(msgs({"role": "user", "content": [
        {"type": "text", "text": "one "}, {"type": "text", "text": "two"}]}), False)
    assert message == {"role": "user", "content": "one two"}


def test_image_parts_are_refused():
    with pytest.raises(TemplateError, match="image content is not supported by this model"):
        template_messages(msgs({"role": "user", "content": [
            {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}), False)


def test_roles_names_and_missing_content():
    out = template_messages(msgs({"role": "developer", "content": "d", "name": "ops"},
                                 {"role": "user"}, {"role": "tool", "content": "42", "tool_call_id": "7"}), False)
    assert out == [{"role": "system", "content": "d", "name": "ops"}, {"role": "user", "content": ""},
                   {"role": "tool", "content": "42", "tool_call_id": "7"}]


CALLS = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
    {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}


def test_tool_calls_go_to_a_template_that_supports_tools():
    [message] = template_messages(msgs(CALLS), True)
    assert message == {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}


def test_tool_calls_are_written_into_content_for_other_templates():
    [message] = template_messages(msgs(CALLS), False)
    assert message == {"role": "assistant", "content":
                       '{"name": "f", "arguments": {"x": 1}}\n{"name": "g", "arguments": "not json"}'}
    first_call = {**CALLS, "content": "Let me check.", "tool_calls": CALLS["tool_calls"][:1]}
    [with_text] = template_messages(msgs(first_call), False)
    assert with_text["content"] == 'Let me check.\n{"name": "f", "arguments": {"x": 1}}'


def test_rendering_needs_neither_torch_nor_transformers():
    code = ("import sys, tgi_router.openai_compat.chat_template, tgi_router.openai_compat.protocol; "
            "print(any(m in sys.modules for m in ('torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"
