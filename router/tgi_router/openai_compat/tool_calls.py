"""Tool calling: the grammar a tool_choice imposes, and reading the call back
out of the generated text, whole or while it streams.

A call is generated as the JSON text `{"name": "<tool>", "arguments": {...}}`
(compact, properties in that order, enforced by the grammar). Its
`arguments` string is the generated text of the arguments object itself,
unchanged, so a streamed call (name first, then argument fragments)
reassembles to exactly the string of the non-streamed answer, and that
string validates against the tool's parameters because the grammar did.

- "required" / a named function: the grammar admits only calls (of any
  tool / of that tool).
- "auto": a Lark grammar whose first character decides: `{` starts a call
  that must be valid, anything else is free text. The model chooses; the
  answer has the right shape either way (TGI's "auto" forces a call).
- "none" or no tools: no grammar, tools are not shown to the model.

Arguments admit only the declared parameters (`additionalProperties: false`
where a parameters schema leaves it open, as OpenAI's strict mode): an
undeclared argument is a hallucination no tool can use.
"""

import json
import re
import secrets
from dataclasses import dataclass

from tgi_router.errors import ToolError
from tgi_router.text.grammar import JSON_OPTIONS, ValidGrammar, closed_schema, json_grammar, lark_grammar

__all__ = ["ToolPlan", "ToolCall", "plan_tools", "parse_tool_call", "ToolCallStream", "new_call_id"]

_ARGUMENTS_KEY = '"arguments": '
_ARGUMENTS_AT = re.compile(r'"arguments"\s*:\s*')


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools and tool_choice mean for generation: the
    tools to show the template (None: none) and the grammar (None: free)."""
    tools: list[dict] | None
    grammar: ValidGrammar | None


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object as text, exactly as generated


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def plan_tools(tools: list[dict] | None, choice: str | dict | None) -> ToolPlan:
    """tools: OpenAI tool objects as dicts ({"type": "function", "function":
    {"name", "parameters", ...}}); choice: "none" | "auto" | "required" |
    {"type": "function", "function": {"name": ...}} (None: "auto" with
    tools, as OpenAI). Raises ToolError / ValidationError (422)."""
    if not tools or choice == "none":
        return ToolPlan(tools=None, grammar=None)
    functions = [t["function"] for t in tools]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("tool names must be unique")
    if isinstance(choice, dict):
        wanted = choice["function"]["name"]
        if wanted not in names:
            raise ToolError(f"Tool choice '{wanted}' not found in the tools")
        functions = [f for f in functions if f["name"] == wanted]
        return ToolPlan(tools, json_grammar(_calls_schema(functions)))
    if choice == "required":
        return ToolPlan(tools, json_grammar(_calls_schema(functions)))
    schema = dict(_calls_schema(functions), **{"x-guidance": JSON_OPTIONS})
    lark = f"start: call | text\ncall: %json {json.dumps(schema)}\ntext: /[^{{](.|\\n)*/\n"
    return ToolPlan(tools, lark_grammar(lark))


def _calls_schema(functions: list[dict]) -> dict:
    calls = [{
        "type": "object",
        "properties": {"name": {"const": f["name"]},
                       "arguments": closed_schema(f.get("parameters") or {"type": "object", "properties": {}})},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for f in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def parse_tool_call(text: str) -> ToolCall | None:
    """The call in a finished generation, or None when the text is no
    complete call (free text under "auto", or cut short by max_tokens)."""
    if not text.startswith("{"):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or "arguments" not in value:
        return None
    # The grammar writes "arguments" last, after the name; its value runs to
    # the brace that closes the call.
    start = _ARGUMENTS_AT.search(text).end()
    return ToolCall(value["name"], text[start:text.rindex("}")].rstrip())


class ToolCallStream:
    """Splits streamed text into content or one tool call, as it arrives.

    `feed(text)` returns what can be sent now: ("content", text),
    ("name", tool name) once the call's name is complete, or ("arguments",
    fragment); `finish()` returns the held-back tail. The last character of
    a call is held back until the end: it may be the brace that closes the
    call, which is not part of the arguments."""

    def __init__(self, may_call: bool):
        self._mode: str | None = None if may_call else "content"
        self._buffer = ""
        self._named = False
        self._sent_args = 0  # characters of arguments already sent

    @property
    def is_call(self) -> bool:
        return self._mode == "call"

    def feed(self, text: str) -> list[tuple[str, str]]:
        if self._mode == "content":
            return [("content", text)] if text else []
        self._buffer += text
        if self._mode is None:
            if not self._buffer:
                return []
            if not self._buffer.startswith("{"):
                self._mode = "content"
                text, self._buffer = self._buffer, ""
                return [("content", text)]
            self._mode = "call"
        return self._call_parts(final=False)

    def finish(self) -> list[tuple[str, str]]:
        if self._mode != "call":
            return []
        return self._call_parts(final=True)

    def _call_parts(self, final: bool) -> list[tuple[str, str]]:
        start = self._buffer.find(_ARGUMENTS_KEY)
        if start < 0:
            return []
        out = []
        args_start = start + len(_ARGUMENTS_KEY)
        if not self._named:
            self._named = True
            out.append(("name", json.loads(self._buffer[:start].rstrip(", ") + "}")["name"]))
        if not final:
            end = len(self._buffer) - 1
        else:  # a complete call's closing brace is no argument; a cut-short call's last brace is
            call = parse_tool_call(self._buffer)
            end = args_start + len(call.arguments) if call is not None else len(self._buffer)
        fragment = self._buffer[args_start + self._sent_args:end]
        if fragment:
            self._sent_args += len(fragment)
            out.append(("arguments", fragment))
        return out
