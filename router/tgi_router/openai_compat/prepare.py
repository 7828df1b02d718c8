"""OpenAI requests into validated generation requests: sampling parameters
mapped onto TGI's, the chat template applied, tools and response_format
turned into grammars, `n` choices as `n` requests with their own seeds.

Runs in a worker thread (templating and tokenizing are CPU work); every
problem is a TGIError with status 422.
"""

import dataclasses
import json
import random
from dataclasses import dataclass

import pydantic

from tgi_router.errors import ToolError, ValidationError
from tgi_router.openai_compat.chat_template import DEFAULT_TOOL_PROMPT, ChatTemplate, template_messages
from tgi_router.openai_compat.protocol import ChatCompletionRequest, CompletionRequest
from tgi_router.openai_compat.tool_calls import ToolPlan, plan_tools
from tgi_router.request.protocol import GenerateParameters, GenerateRequest
from tgi_router.request.validation import ValidationLimits, ValidGenerateRequest, check_grammar_budget, validate
from tgi_router.text.grammar import ValidGrammar, closed_schema, json_grammar, regex_grammar
from tgi_router.text.tokenizer import RouterTokenizer

__all__ = ["MAX_CHOICES", "PreparedChat", "chat_tools", "prepare_chat", "prepare_completion", "render_chat"]

MAX_CHOICES = 16  # `n` at most (TGI has no `n`; OpenAI allows 128)


@dataclass(frozen=True)
class PreparedChat:
    requests: list[ValidGenerateRequest]  # one per choice
    tools: ToolPlan
    templated_text: str


def render_chat(body: ChatCompletionRequest, template: ChatTemplate, tools: ToolPlan) -> str:
    """The prompt text: the messages (and tools the template must show)
    through the chat template; a failure raises chat_template.TemplateError,
    TGI's 422 template_error."""
    messages = template_messages(body.messages, template.supports_tools)
    return template.render(messages, tools=tools.tools, tool_prompt=body.tool_prompt or DEFAULT_TOOL_PROMPT,
                           add_generation_prompt=True, extra=body.chat_template_kwargs)


def prepare_chat(body: ChatCompletionRequest, template: ChatTemplate, tokenizer: RouterTokenizer,
                 limits: ValidationLimits) -> PreparedChat:
    _check_common(body.n, body.presence_penalty, body.top_p)
    tools = chat_tools(body)
    grammar = _response_format_grammar(body.response_format)
    if grammar is not None and tools.grammar is not None:
        raise ToolError("response_format cannot be combined with tools; use tool_choice \"none\"")
    grammar = grammar or tools.grammar
    if grammar is not None and limits.disable_grammar_support:
        raise ValidationError("grammar is not supported")
    if body.top_logprobs is not None and not body.logprobs:
        raise ValidationError("`top_logprobs` requires `logprobs` to be true")
    text = render_chat(body, template, tools)
    params = _parameters(body, max_new_tokens=_max_tokens(body.max_completion_tokens, body.max_tokens),
                         top_n=body.top_logprobs if body.logprobs else None, limits=limits)
    # The template already wrote BOS and every special token the model expects.
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    valid = validate(GenerateRequest(inputs=text, parameters=params), encode, limits)
    check_grammar_budget(grammar, valid.stopping.max_total_new_tokens, lambda s: len(encode(s)))
    return PreparedChat(_choices(valid, body, grammar), tools, text)


def prepare_completion(body: CompletionRequest, tokenizer: RouterTokenizer,
                       limits: ValidationLimits) -> list[ValidGenerateRequest]:
    """One request per (prompt, choice), prompt-major: choice index
    `prompt_index * n + j`."""
    _check_common(body.n, body.presence_penalty, body.top_p)
    prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
    if not prompts:
        raise ValidationError("`prompt` cannot be empty")
    if body.suffix:
        raise ValidationError("`suffix` is not supported")
    if body.best_of is not None and body.best_of != body.n:
        raise ValidationError("`best_of` is not supported; use `n`")
    params = _parameters(body, max_new_tokens=body.max_tokens, top_n=body.logprobs, limits=limits)
    out = []
    for prompt in prompts:
        valid = validate(GenerateRequest(inputs=prompt, parameters=params), tokenizer.encode, limits)
        out.extend(_choices(valid, body, None))
    return out


def chat_tools(body: ChatCompletionRequest) -> ToolPlan:
    """The tools shown to the model and the grammar their tool_choice imposes."""
    choice = body.tool_choice
    return plan_tools([t.model_dump() for t in body.tools] if body.tools else None,
                      choice if choice is None or isinstance(choice, str) else choice.model_dump())


def _check_common(n: int, presence_penalty: float | None, top_p: float | None) -> None:
    if not 1 <= n <= MAX_CHOICES:
        raise ValidationError(f"`n` must be >= 1 and <= {MAX_CHOICES}. Given: {n}")
    if presence_penalty is not None and not -2.0 <= presence_penalty <= 2.0:
        raise ValidationError("`presence_penalty` must be >= -2.0 and <= 2.0")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValidationError("`top_p` must be > 0.0 and <= 1.0")


def _max_tokens(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


def _parameters(body: ChatCompletionRequest | CompletionRequest, *, max_new_tokens: int | None,
                top_n: int | None, limits: ValidationLimits) -> GenerateParameters:
    """OpenAI's sampling fields as TGI's: temperature 0 is greedy, no
    temperature samples at 1.0 (both as TGI's chat route), top_p 1.0 is off.
    `model` names a LoRA adapter when the server loaded any ("tgi" and the
    base model's id name none); without adapters any `model` is the base."""
    temperature = body.temperature
    greedy = temperature is not None and temperature == 0.0
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        return GenerateParameters(
            do_sample=not greedy, temperature=None if greedy else temperature,
            top_p=body.top_p if body.top_p is not None and body.top_p < 1.0 else None,
            frequency_penalty=body.frequency_penalty, max_new_tokens=max_new_tokens, stop=stop,
            seed=body.seed, top_n_tokens=top_n, details=True,
            adapter_id=body.model if limits.adapters and body.model != "tgi" else None)
    except pydantic.ValidationError as err:  # a value outside TGI's types (a negative seed, ...)
        first = err.errors()[0]
        raise ValidationError(f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None


def _response_format_grammar(fmt) -> ValidGrammar | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":  # TGI's form may carry a schema in `value`
        return json_grammar(_json_value(fmt.value) if fmt.value is not None else {"type": "object"})
    if fmt.type == "json_schema":
        schema = fmt.json_schema.schema_
        schema = schema if schema is not None else {"type": "object"}
        return json_grammar(closed_schema(schema) if fmt.json_schema.strict else schema)
    if fmt.type == "json":
        return json_grammar(_json_value(fmt.value))
    return regex_grammar(fmt.value)


def _json_value(value: dict | str) -> dict:
    """TGI's `json` value: a schema, or a string holding one (as TGI reads it)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (json.JSONDecodeError, RecursionError) as err:
        raise ValidationError(f"grammar is not valid: {err}") from None


def _choices(valid: ValidGenerateRequest, body: ChatCompletionRequest | CompletionRequest,
             grammar: ValidGrammar | None) -> list[ValidGenerateRequest]:
    """`n` copies: the first keeps the request's seed, the others draw theirs
    from it (so a seeded request with n > 1 is reproducible as a whole)."""
    presence = body.presence_penalty or 0.0
    rng = random.Random(valid.parameters.seed)
    out = []
    for i in range(body.n):
        seed = valid.parameters.seed if i == 0 else rng.getrandbits(64)
        params = dataclasses.replace(valid.parameters, seed=seed, grammar=grammar, presence_penalty=presence)
        out.append(dataclasses.replace(valid, parameters=params))
    return out
