"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions (both
streaming or not), /v1/models, and TGI's /chat_tokenize.

A request becomes `n` engine requests (openai_prepare); their results are
shaped as OpenAI's objects here, streamed as chunks by openai_stream.
"""

import asyncio
import logging
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tgi_router.errors import BatchSizeExceededError
from tgi_router.openai_compat import protocol as o
from tgi_router.openai_compat.chat_template import ChatTemplate, TemplateError
from tgi_router.openai_compat.prepare import PreparedChat, chat_tools, prepare_chat, prepare_completion, render_chat
from tgi_router.openai_compat.stream import (
    ResponseMeta,
    chat_chunks,
    chat_token_logprobs,
    completion_chunks,
    completion_logprobs,
    finish_reason,
    usage,
)
from tgi_router.openai_compat.tool_calls import ToolPlan, new_call_id, parse_tool_call
from tgi_router.request import protocol as p
from tgi_router.request.validation import check_input_chars, tokenize_text
from tgi_router.scheduling.request_stream import RequestStream, SequenceResult
from tgi_router.text.reasoning import ReasoningParser
from tgi_router.tgi_api.responses import timing_headers
from tgi_router.web.admission import Admitted, Gate

__all__ = ["add_openai_routes"]

log = logging.getLogger("tgi_router")


def add_openai_routes(app: FastAPI, gate: Gate) -> None:
    engine, settings = gate.engine, gate.settings
    tokenizer = engine.tokenizer
    model_id = settings.info.model_id
    fingerprint = f"{settings.info.version}-{settings.info.docker_label or 'native'}"
    started = int(time.time())
    template, template_problem = _load_template(tokenizer)

    def chat_template() -> ChatTemplate:
        if template is None:
            raise TemplateError(template_problem)
        return template

    def sse(admitted: Admitted, chunks) -> StreamingResponse:
        async def body():
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                admitted.close()
        headers = {"x-compute-type": settings.compute_type, "x-accel-buffering": "no", "cache-control": "no-cache"}
        return StreamingResponse(body(), media_type="text/event-stream", headers=headers)

    @app.post("/v1/chat/completions", response_model=o.ChatCompletion, tags=["OpenAI"])
    async def chat_completions(request: Request, body: o.ChatCompletionRequest):
        """OpenAI's chat completions, with tools, response_format and n."""
        prepared: list[PreparedChat] = []

        def prepare():
            prepared.append(prepare_chat(body, chat_template(), tokenizer, settings.limits))
            return prepared[0].requests
        admitted = await gate.admit(prepare)
        meta = ResponseMeta("chatcmpl-" + secrets.token_hex(12), int(time.time()), model_id, fingerprint)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse(admitted, chat_chunks(gate, admitted, meta, prepared[0].tools, body.logprobs,
                                             include_usage, tokenizer, settings.reasoning))
        try:
            await gate.wait(request, admitted)
        finally:
            admitted.close()
        choices = [_chat_choice(i, s, prepared[0].tools, body.logprobs, settings.reasoning)
                   for i, s in enumerate(admitted.streams)]
        answer = o.ChatCompletion(id=meta.id, created=meta.created, model=model_id, system_fingerprint=fingerprint,
                                  choices=choices, usage=usage(admitted.streams, len(admitted.streams)))
        return JSONResponse(answer.model_dump(mode="json"),
                            headers=timing_headers(admitted.streams[0], settings.compute_type))

    @app.post("/v1/completions", response_model=o.Completion, tags=["OpenAI"])
    async def completions(request: Request, body: o.CompletionRequest):
        """OpenAI's legacy completions: a prompt or a list of prompts."""
        def prepare():
            if isinstance(body.prompt, list) and len(body.prompt) > settings.info.max_client_batch_size:
                raise BatchSizeExceededError(str(settings.info.max_client_batch_size))
            return prepare_completion(body, tokenizer, settings.limits)
        admitted = await gate.admit(prepare)
        meta = ResponseMeta("cmpl-" + secrets.token_hex(12), int(time.time()), model_id, fingerprint)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse(admitted, completion_chunks(gate, admitted, meta, body.n, body.logprobs is not None,
                                                   body.echo, include_usage))
        try:
            await gate.wait(request, admitted)
        finally:
            admitted.close()
        choices = [_completion_choice(i, s, body.logprobs is not None, body.echo)
                   for i, s in enumerate(admitted.streams)]
        answer = o.Completion(id=meta.id, created=meta.created, model=model_id, system_fingerprint=fingerprint,
                              choices=choices, usage=usage(admitted.streams, body.n))
        return JSONResponse(answer.model_dump(mode="json"),
                            headers=timing_headers(admitted.streams[0], settings.compute_type))

    @app.get("/v1/models", response_model=o.ModelList, tags=["OpenAI"])
    async def models():
        """The model this server serves, then its LoRA adapters (each a `model` a request may name)."""
        ids = [model_id, *settings.limits.adapters]
        listing = o.ModelList(data=[o.Model(id=name, created=started, owned_by=model_id) for name in ids])
        return JSONResponse(listing.model_dump(mode="json"))

    @app.post("/chat_tokenize", response_model=p.ChatTokenizeResponse, tags=["Text Generation Inference"])
    async def chat_tokenize(body: o.ChatCompletionRequest):
        """The chat template's text for these messages, and its tokens
        (refused, untokenized, when too long to serve)."""
        def run():
            text = render_chat(body, chat_template(), chat_tools(body))
            check_input_chars(text, settings.limits)
            return text, tokenize_text(tokenizer, text, add_special_tokens=False)
        text, tokens = await asyncio.to_thread(run)
        return JSONResponse({"tokenize_response": [p.SimpleToken(id=i, text=t, start=a, stop=b).model_dump()
                                                   for i, t, a, b in tokens],
                             "templated_text": text})


def _load_template(tokenizer) -> tuple[ChatTemplate | None, str]:
    config = tokenizer.config
    try:
        return ChatTemplate(config.chat_template, config.bos_token, config.eos_token), ""
    except TemplateError as err:
        log.warning("the chat template does not compile: %s", err)
        return None, f"the chat template does not compile: {err}"


def _result(stream: RequestStream) -> SequenceResult:
    return stream.best()[0]


def _chat_choice(index: int, stream: RequestStream, tools: ToolPlan, logprobs: bool,
                 reasoning: ReasoningParser | None) -> o.ChatChoice:
    result = _result(stream)
    thoughts, text = reasoning.split(result.generated_text) if reasoning else (None, result.generated_text)
    call = parse_tool_call(text) if tools.grammar is not None else None
    if call is not None:
        message = {"role": "assistant", "content": None, "tool_calls": [
            {"id": new_call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}
    else:
        message = {"role": "assistant", "content": text}
    if thoughts is not None:
        message["reasoning_content"] = thoughts
    return o.ChatChoice.model_validate({
        "index": index, "message": message,
        "logprobs": {"content": chat_token_logprobs(result.tokens, result.top_tokens)} if logprobs else None,
        "finish_reason": finish_reason(result, call is not None)})


def _completion_choice(index: int, stream: RequestStream, logprobs: bool, echo: bool) -> o.CompletionChoice:
    result = _result(stream)
    prefix = stream.request.inputs if echo else ""
    return o.CompletionChoice.model_validate({
        "index": index, "text": prefix + result.generated_text,
        "logprobs": completion_logprobs(result.tokens, result.top_tokens, len(prefix)) if logprobs else None,
        "finish_reason": finish_reason(result, False)})
