"""OpenAI's request bodies for `/v1/chat/completions` and `/v1/completions`,
as the `openai` SDK sends them, plus TGI's extensions (`tool_prompt`,
`chat_template_kwargs`, and `response_format` of type `json` or `regex`).

Parsing follows the native schemas' rules (protocol.py): unknown fields are
ignored (the SDK sends many we do not serve: `store`, `metadata`,
`functions`...), JSON types are strict (no "5" for 5, no 1.0 for an
integer), NaN and infinities are refused, integers keep TGI's Rust widths and
floats are rounded to f32. Every field also takes `null`, which the SDK sends
when a caller passes `None`: a null means the field's default, and for a
required field it means missing. Ranges (penalties within -2..2, `n`,
`top_logprobs`...) are the routes' checks, not the parser's.
"""

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from tgi_router.request.protocol import F32, U32, U64


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


# ---------------------------------------------------------------- messages


class TextContentPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ImageUrl(_Request):
    url: StrictStr
    detail: StrictStr | None = None


class ImageContentPart(_Request):
    """Parsed so that the chat route can refuse it with a clear message."""
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextContentPart | ImageContentPart, Field(discriminator="type")]


class FunctionCall(_Request):
    """`arguments` is the call's JSON object as a string, as OpenAI sends it."""
    name: StrictStr
    arguments: StrictStr


class ToolCall(_Request):
    """A tool call of an assistant message; also written in answers."""
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    """One message of a conversation. `content` may be absent or null (an
    assistant message that only calls tools); `tool_call_id` links a tool
    message to the call it answers."""
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None


# ------------------------------------------------------------------- tools


class FunctionDefinition(_Request):
    """`parameters` is the function's JSON Schema; absent means no arguments."""
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}})
    strict: StrictBool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Request):
    name: StrictStr


class NamedToolChoice(_Request):
    """`{"type": "function", "function": {"name": ...}}`: call this tool."""
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# ---------------------------------------------------------- response format


class ResponseFormatText(_Request):
    type: Literal["text"]


class ResponseFormatJsonObject(_Request):
    """OpenAI's JSON mode: any JSON object. TGI's form also carries a schema
    in `value`."""
    type: Literal["json_object"]
    value: dict[str, Any] | StrictStr | None = None


class JsonSchemaSpec(_Request):
    """`json_schema` of OpenAI's structured outputs; `schema` may be absent."""
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    model_config = ConfigDict(validate_by_name=True, serialize_by_alias=True)


class ResponseFormatJsonSchema(_Request):
    """OpenAI's `{"type": "json_schema", "json_schema": {...}}`; TGI's
    native spelling puts the same object under `value`."""
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec = Field(
        validation_alias=AliasChoices("json_schema", "value"))


class ResponseFormatJson(_Request):
    """TGI's `{"type": "json", "value": schema}`; the schema may be a string
    holding one."""
    type: Literal["json"]
    value: dict[str, Any] | StrictStr


class ResponseFormatRegex(_Request):
    """TGI's `{"type": "regex", "value": pattern}`."""
    type: Literal["regex"]
    value: StrictStr


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema
    | ResponseFormatJson | ResponseFormatRegex,
    Field(discriminator="type")]


class StreamOptions(_Request):
    include_usage: StrictBool = False


TextOrTexts = StrictStr | list[StrictStr]


# ---------------------------------------------------------------- requests


class ChatCompletionRequest(_Request):
    """Body of `/v1/chat/completions`. `logit_bias` is accepted and ignored;
    `max_completion_tokens` is OpenAI's newer name for `max_tokens`."""
    model: StrictStr = "tgi"
    messages: list[ChatMessage] = Field(min_length=1)
    frequency_penalty: F32 | None = None
    presence_penalty: F32 | None = None
    logit_bias: dict[StrictStr, F32] | None = None
    logprobs: StrictBool = False
    top_logprobs: U32 | None = None
    max_tokens: U32 | None = None
    max_completion_tokens: U32 | None = None
    n: U32 = 1
    seed: U64 | None = None
    stop: TextOrTexts | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: F32 | None = None
    top_p: F32 | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    tool_prompt: StrictStr | None = None
    response_format: ResponseFormat | None = None
    user: StrictStr | None = None
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: dict[StrictStr, Any] | None = None


class CompletionRequest(_Request):
    """Body of `/v1/completions`. `prompt` is one text or a list of texts
    (token-id prompts are refused); `logprobs` is a count of top tokens, as
    in OpenAI's legacy API. `logit_bias` is accepted and ignored."""
    model: StrictStr = "tgi"
    prompt: TextOrTexts
    max_tokens: U32 | None = None
    temperature: F32 | None = None
    top_p: F32 | None = None
    n: U32 = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logprobs: U32 | None = None
    echo: StrictBool = False
    stop: TextOrTexts | None = None
    seed: U64 | None = None
    frequency_penalty: F32 | None = None
    presence_penalty: F32 | None = None
    suffix: StrictStr | None = None
    best_of: U32 | None = None
    user: StrictStr | None = None
    logit_bias: dict[StrictStr, F32] | None = None
