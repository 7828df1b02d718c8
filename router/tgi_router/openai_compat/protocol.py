"""OpenAI's wire format in one import: the request bodies
(openai_requests.py) and the answers (openai_responses.py) of
`/v1/chat/completions`, `/v1/completions` and `/v1/models`."""

from tgi_router.openai_compat.requests import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    FunctionName,
    ImageContentPart,
    ImageUrl,
    JsonSchemaSpec,
    NamedToolChoice,
    ResponseFormat,
    ResponseFormatJson,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    ResponseFormatRegex,
    ResponseFormatText,
    StreamOptions,
    TextContentPart,
    TextOrTexts,
    Tool,
    ToolCall,
    ToolChoice,
)
from tgi_router.openai_compat.responses import (
    VERY_UNLIKELY,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatFinishReason,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionFinishReason,
    CompletionLogprobs,
    FunctionCallDelta,
    Model,
    ModelList,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)

__all__ = [
    # requests
    "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "ContentPart",
    "FunctionCall", "FunctionDefinition", "FunctionName", "ImageContentPart",
    "ImageUrl", "JsonSchemaSpec", "NamedToolChoice", "ResponseFormat",
    "ResponseFormatJson", "ResponseFormatJsonObject", "ResponseFormatJsonSchema",
    "ResponseFormatRegex", "ResponseFormatText", "StreamOptions",
    "TextContentPart", "TextOrTexts", "Tool", "ToolCall", "ToolChoice",
    # responses
    "VERY_UNLIKELY", "AssistantMessage", "ChatChoice", "ChatCompletion",
    "ChatCompletionChunk", "ChatFinishReason", "ChoiceLogprobs", "ChunkChoice",
    "ChunkDelta", "Completion", "CompletionChoice", "CompletionChunk",
    "CompletionFinishReason", "CompletionLogprobs", "FunctionCallDelta", "Model",
    "ModelList", "TokenLogprob", "ToolCallDelta", "TopLogprob", "Usage",
]
