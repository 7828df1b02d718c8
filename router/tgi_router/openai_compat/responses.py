"""OpenAI's answers for `/v1/chat/completions`, `/v1/completions` and
`/v1/models`, written as OpenAI writes them.

Nulls that OpenAI writes are written (`"logprobs": null` in a choice,
`"content": null` beside tool calls, `"finish_reason": null` until a stream's
last chunk); the fields of a stream's `delta` are written only when set. A
chunk writes `usage` only when the route passed it, even as None: with
`stream_options.include_usage` OpenAI writes `"usage": null` on every chunk and
the usage on a last chunk whose `choices` is empty; without it, no `usage` key.

A logprob that is not finite (a token the sampler could not pick) is written
as -9999.0, the value OpenAI documents for "very unlikely": JSON has no -inf.
"""

import math
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, PlainSerializer, SerializerFunctionWrapHandler, model_serializer

from tgi_router.openai_compat.requests import ToolCall

VERY_UNLIKELY = -9999.0


def _finite_logprob(value: float) -> float:
    return value if math.isfinite(value) else VERY_UNLIKELY


Logprob = Annotated[float, PlainSerializer(_finite_logprob)]
ChatFinishReason = Literal["stop", "length", "tool_calls"]
CompletionFinishReason = Literal["stop", "length"]


class _Response(BaseModel):
    """Fields in `omit_if_none` vanish when None; fields in `omit_unless_set`
    vanish unless given to the constructor."""
    omit_if_none: ClassVar[tuple[str, ...]] = ()
    omit_unless_set: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in self.omit_if_none:
            if data.get(name, 0) is None:
                del data[name]
        for name in self.omit_unless_set:
            if name not in self.model_fields_set:
                data.pop(name, None)
        return data


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# -------------------------------------------------------------------- chat


class TopLogprob(_Response):
    """`bytes` is the token's UTF-8 bytes, or None when it has none alone."""
    token: str
    logprob: Logprob
    bytes: list[int] | None = None


class TokenLogprob(_Response):
    token: str
    logprob: Logprob
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None


class AssistantMessage(_Response):
    """`content` is written as null for a message that only calls tools;
    `reasoning_content` (vLLM's field: the thoughts, with --reasoning-parser)
    only when the answer had thoughts."""
    omit_if_none = ("tool_calls", "reasoning_content")
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: ChatFinishReason


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(_Response):
    omit_if_none = ("name", "arguments")
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Response):
    """A piece of the tool call at `index`: its first piece carries `id`,
    `type` and the function's name, later ones pieces of `arguments`."""
    omit_if_none = ("id", "type", "function")
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChunkDelta(_Response):
    omit_if_none = ("role", "content", "reasoning_content", "tool_calls")
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(_Response):
    index: int
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: ChatFinishReason | None = None


class ChatCompletionChunk(_Response):
    """One SSE event of a chat stream. Pass `usage` (None on every chunk but
    the last) only when the request asked for `include_usage`."""
    omit_unless_set = ("usage",)
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChunkChoice]
    usage: Usage | None = None


# ------------------------------------------------------------- completions


class CompletionLogprobs(_Response):
    """OpenAI's legacy logprobs, one entry per token. `text_offset` counts
    characters from the start of the choice's text (or of the echoed prompt).
    With `echo`, the first prompt token's logprob and top dict are null."""
    tokens: list[str]
    token_logprobs: list[Logprob | None]
    top_logprobs: list[dict[str, Logprob] | None]
    text_offset: list[int]


class CompletionChoice(_Response):
    """`finish_reason` is null on a stream's chunks until the choice's last."""
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: CompletionFinishReason | None = None


class Completion(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(Completion):
    """One SSE event of a completion stream: a `Completion` (OpenAI names it
    "text_completion" too) whose `usage` is as in `ChatCompletionChunk`."""
    omit_unless_set = ("usage",)
    usage: Usage | None = None


# ------------------------------------------------------------------ models


class Model(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[Model]
