"""OpenAI's routes (/v1/chat/completions, /v1/completions, /v1/models,
/chat_tokenize): their request and answer JSON, chat templates, tools and
tool calls, response_format, and streamed chunks.

May import: tgi_api (its timing headers), web, scheduling, request, text,
tgi_router.errors."""
