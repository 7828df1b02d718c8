"""Hugging Face chat templates rendered as transformers renders them, without
transformers: the same sandboxed Jinja environment (trim_blocks,
lstrip_blocks, loop controls, `{% generation %}` blocks), the same globals
(`raise_exception`, `strftime_now`) and the same `tojson` filter, with the
variables TGI gives a template (`messages`, `bos_token`, `eos_token`,
`add_generation_prompt`, `tools`), `documents` (None, as transformers passes
it) and the request's `chat_template_kwargs`.

The template is the model's, chosen by whoever runs the server; the sandbox is
defence in depth against a hostile one, not a CPU-time limit. It refuses
private and internal attributes (`''.__class__`, `cycler.__init__`) and calls
that mutate, bounds `range`, `*` and `**` so that no huge string, list or
number is built, drops the `lipsum` global, and stops a render whose output
passes `MAX_RENDER_CHARS`. Every failure becomes a `TemplateError` with a
one-line message, the route's 422 `template_error`.
"""

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tgi_router import errors
from tgi_router.openai_compat.requests import ChatMessage, ImageContentPart, ToolCall

# TGI's default tool prompt, saying `arguments` where TGI says `parameters`:
# our tool calls are {"name": ..., "arguments": {...}}.
DEFAULT_TOOL_PROMPT = (
    "Given the functions available, please respond with a JSON for a function call "
    "with its proper arguments that best answers the given prompt.\n\n"
    "Respond in the format {name: function name, arguments: dictionary of argument "
    "name and its value}.Do not use variables.")

# Eight times TGI's default 2 MB payload: room for a template that repeats
# its inputs, none for one that multiplies them without bound.
MAX_RENDER_CHARS = 16_000_000
# Bits of an integer `**` may build.
_MAX_POWER_BITS = 4096
# Variables the render sets itself; `chat_template_kwargs` cannot replace them.
_RESERVED = frozenset({"messages", "tools", "add_generation_prompt"})


class TemplateError(errors.TemplateError, ValueError):
    """A template that does not compile or fails to render; `str(err)` is one
    line (for `raise_exception`, the template's own message). It is the
    router's typed `errors.TemplateError`, so it maps to TGI's 422."""


def _raise_exception(message: Any) -> None:
    raise TemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML; transformers' (this) does not.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for
    transformers' training masks; a render keeps its body as it is."""
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _repeat_size(left: Any, right: Any) -> int:
    """Items `left * right` builds when it repeats a sequence, else 0."""
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
            return len(seq) * count
    return 0


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' environment with `*` and `**` bounded. Intercepting them
    also keeps Jinja from folding `10**10**10` while compiling."""
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str,
                   left: Any, right: Any) -> Any:
        if operator == "*" and _repeat_size(left, right) > MAX_RENDER_CHARS:
            raise jinja2.exceptions.SecurityError("the product is too large")
        if (operator == "**" and isinstance(left, int) and isinstance(right, int)
                and abs(left) > 1 and right * left.bit_length() > _MAX_POWER_BITS):
            raise jinja2.exceptions.SecurityError("the power is too large")
        return super().call_binop(context, operator, left, right)


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    # The sandbox's `range` already refuses more than jinja2.sandbox.MAX_RANGE
    # items; `lipsum(n)` has no such bound.
    del env.globals["lipsum"]
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, jinja2.TemplateSyntaxError) and err.lineno:
        text = f"{text} (line {err.lineno})"
    return text


class ChatTemplate:
    """A model's chat template, compiled once.

    `template` None means the model has none: construction succeeds and
    every `render` raises TemplateError. A template that does not compile
    raises TemplateError here. `supports_tools` says whether the template
    reads the `tools` variable; when it does not, `render` writes the tools
    into the last message, as TGI does.
    """

    def __init__(self, template: str | None, bos_token: str | None, eos_token: str | None):
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template: jinja2.Template | None = None
        self._supports_tools = False
        if template is None:
            return
        env = _environment()
        try:
            ast = env.parse(template)
            self._supports_tools = "tools" in meta.find_undeclared_variables(ast)
            self._template = env.from_string(ast)
        except Exception as err:  # syntax errors, unknown tags, bounded constants...
            raise TemplateError(_one_line(err)) from None

    @property
    def supports_tools(self) -> bool:
        return self._supports_tools

    def render(self, messages: list[dict], *, tools: list[dict] | None = None,
               tool_prompt: str | None = None, add_generation_prompt: bool = True,
               extra: dict | None = None) -> str:
        """The prompt for `messages` (dicts as `template_messages` makes
        them; the caller's dicts are not changed). `tools` are OpenAI tool
        dicts ({"type": "function", "function": {...}}); a template that does
        not read them gets, appended to the last message's content, "\\n---\\n",
        `tool_prompt` (default DEFAULT_TOOL_PROMPT), "\\n" and the tools'
        JSON. `extra` adds template variables but cannot replace `messages`,
        `tools` or `add_generation_prompt`. Raises TemplateError only."""
        if self._template is None:
            raise TemplateError("This model has no chat template")
        messages = [dict(message) for message in messages]
        if tools and not self._supports_tools:
            _append_tools(messages, tools, tool_prompt or DEFAULT_TOOL_PROMPT)
            tools = None
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, "documents": None}
        context.update((k, v) for k, v in (extra or {}).items() if k not in _RESERVED)
        context.update(messages=messages, tools=tools or None,
                       add_generation_prompt=add_generation_prompt)
        try:
            return self._generate(context)
        except TemplateError:
            raise
        except Exception as err:  # undefined, sandbox, type, recursion, overflow...
            raise TemplateError(_one_line(err)) from None

    def _generate(self, context: dict[str, Any]) -> str:
        pieces, size = [], 0
        for piece in self._template.generate(context):
            size += len(piece)
            if size > MAX_RENDER_CHARS:
                raise TemplateError(f"the rendered prompt passes {MAX_RENDER_CHARS} characters")
            pieces.append(piece)
        return "".join(pieces)


def _append_tools(messages: list[dict], tools: list[dict], tool_prompt: str) -> None:
    if not messages:
        return
    tools_json = json.dumps(tools, ensure_ascii=False, separators=(",", ":"))
    last = messages[-1]
    last["content"] = f"{last.get('content') or ''}\n---\n{tool_prompt}\n{tools_json}"


# ----------------------------------------------------- request -> template


def template_messages(messages: list[ChatMessage], supports_tools: bool) -> list[dict]:
    """The dicts a template expects for the request's messages.

    Text parts are joined into one string (as TGI joins them); an image part
    raises TemplateError. "developer" becomes "system". Keys that would be
    None are left out, as transformers leaves them out: `content` is ""
    when absent, except beside tool calls. An assistant's tool calls go to
    `tool_calls` (arguments parsed when they are a JSON object) when the
    template supports tools; otherwise they are written into `content`, one
    `{"name": ..., "arguments": {...}}` line each, after any text.
    """
    return [_template_message(message, supports_tools) for message in messages]


def _template_message(message: ChatMessage, supports_tools: bool) -> dict:
    text = _text(message.content)
    calls = message.tool_calls or []
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
    if calls and not supports_tools:
        text = "\n".join([*([text] if text else []), *map(_call_text, calls)])
    if text is not None or not calls:
        out["content"] = text or ""
    if message.name is not None:
        out["name"] = message.name
    if calls and supports_tools:
        out["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name,
                          "arguments": _arguments(call.function.arguments)}}
            for call in calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _text(content: str | list | None) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if any(isinstance(part, ImageContentPart) for part in content):
        raise TemplateError("image content is not supported by this model")
    return "".join(part.text for part in content)


def _arguments(arguments: str) -> dict | str:
    """The arguments as a JSON object when they are one, else as given."""
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def _call_text(call: ToolCall) -> str:
    return json.dumps({"name": call.function.name,
                       "arguments": _arguments(call.function.arguments)},
                      ensure_ascii=False)
