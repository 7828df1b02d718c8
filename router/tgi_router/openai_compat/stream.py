"""OpenAI's streamed shapes: chat.completion.chunk and text_completion
events, one per token (several choices interleaved by `index`), a last
chunk per choice with its finish_reason, an optional usage chunk, then
`data: [DONE]`.

Content streams exactly the text the non-streamed answer holds: token
texts without special tokens (the EOS token's text is not content). A tool
call streams as OpenAI deltas: its id, type and name first, then argument
fragments that concatenate to the non-streamed `arguments` string.
"""

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tgi_router.errors import GenerationError, error_response
from tgi_router.openai_compat import protocol as o
from tgi_router.openai_compat.tool_calls import ToolCallStream, ToolPlan, new_call_id, parse_tool_call
from tgi_router.scheduling.request_stream import ErrorEvent, RequestStream, SequenceResult, TokenOut
from tgi_router.scheduling.sequence import FinishReason
from tgi_router.text.reasoning import ReasoningParser
from tgi_router.web.admission import Admitted, Gate
from tgi_router.web.sse import compact_json

__all__ = ["ChunkFrame", "ResponseMeta", "chat_chunks", "completion_chunks", "finish_reason", "chat_token_logprobs",
           "completion_logprobs", "usage"]

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class ResponseMeta:
    """What every object of one response repeats."""
    id: str
    created: int
    model: str
    fingerprint: str


def finish_reason(result: SequenceResult, called: bool) -> str:
    if called:
        return "tool_calls"
    return "length" if result.finish_reason == FinishReason.LENGTH else "stop"


def chat_token_logprobs(tokens: list[TokenOut], tops: list[list[TokenOut]]) -> list[dict]:
    """OpenAI's logprobs.content entries for generated tokens."""
    return [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode()),
             "top_logprobs": [{"token": a.text, "logprob": a.logprob, "bytes": list(a.text.encode())}
                              for a in top]}
            for t, top in zip(tokens, tops)]


def completion_logprobs(tokens: list[TokenOut], tops: list[list[TokenOut]], offset: int) -> dict:
    """The legacy completions logprobs object; `offset` is where the first
    token's text starts in the choice's text."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.text)
    return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{a.text: a.logprob for a in top} for top in tops], "text_offset": offsets}


def content_text(token: TokenOut, tokenizer) -> str:
    """A streamed token's text as content: a special token's own text
    dropped (the last token may also carry text held back before it)."""
    if not token.special:
        return token.text
    return token.text.removeprefix(tokenizer.decode([token.id], skip_special_tokens=False))


def _data(model) -> bytes:
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


class ChunkFrame:
    """One response's SSE event bytes around a chunk's `choices`, built once
    from a chunk model with no choices: a token's chunk is then its choice's
    JSON between them, with no model built per token (pydantic's validate
    and dump cost more than the rest of a token's route work together)."""

    def __init__(self, model_cls, fields: dict):
        head, tail = _data(model_cls.model_validate({**fields, "choices": []})).split(b'"choices":[]')
        self.head, self.tail = head + b'"choices":[', b"]" + tail

    def event(self, choice: dict) -> bytes:
        """The event of a chunk whose only choice is `choice` (plain values
        only): byte for byte the event of `model_cls` built with `fields` and
        that choice."""
        return self.head + compact_json(choice) + self.tail


def _error(event: ErrorEvent) -> bytes:
    _, err = error_response(GenerationError(event.message.removeprefix("Request failed during generation: ")))
    return b"data: " + json.dumps(err).encode() + b"\n\n"


async def chat_chunks(gate: Gate, admitted: Admitted, meta: ResponseMeta, tools: ToolPlan, logprobs: bool,
                      include_usage: bool, tokenizer, reasoning: ReasoningParser | None = None
                      ) -> AsyncIterator[bytes]:
    n = len(admitted.streams)
    splitters = [ToolCallStream(may_call=tools.grammar is not None) for _ in range(n)]
    thinkers = [reasoning.stream() for _ in range(n)] if reasoning else None
    call_ids = [new_call_id() for _ in range(n)]

    common = {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
              "system_fingerprint": meta.fingerprint, **({"usage": None} if include_usage else {})}
    frame = ChunkFrame(o.ChatCompletionChunk, common)

    def chunk(choices: list[dict], usage: o.Usage | None = None) -> bytes:
        return _data(o.ChatCompletionChunk.model_validate({**common, "choices": choices,
                                                            **({"usage": usage} if include_usage else {})}))

    def choice(i: int, delta: dict, lp: list[dict] | None = None, finish: str | None = None) -> dict:
        return {"index": i, "delta": delta, "logprobs": {"content": lp} if lp is not None else None,
                "finish_reason": finish}

    for i in range(n):
        yield chunk([choice(i, {"role": "assistant", "content": ""})])
    async for i, event in gate.events(admitted):
        if isinstance(event, ErrorEvent):
            yield _error(event)
            return
        lp = chat_token_logprobs([event.token], [event.top_tokens]) if logprobs else None
        text = content_text(event.token, tokenizer)
        if thinkers is None:
            pieces = [("content", text)]
        else:  # the thoughts go out as they are; the answer on to the tool-call splitter
            pieces = thinkers[i].feed(text) + (thinkers[i].finish() if event.result is not None else [])
        parts = [p for kind, value in pieces
                 for p in ([(kind, value)] if kind == "reasoning" else splitters[i].feed(value))]
        if event.result is not None:
            parts += splitters[i].finish()
        deltas = []
        for kind, value in parts:
            if kind == "reasoning":
                deltas.append({"reasoning_content": value})
            elif kind == "content":
                deltas.append({"content": value})
            elif kind == "name":
                deltas.append({"tool_calls": [{"index": 0, "id": call_ids[i], "type": "function",
                                               "function": {"name": value, "arguments": ""}}]})
            else:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": value}}]})
        if not deltas and lp is not None and not splitters[i].is_call:
            deltas.append({"content": ""})  # the token's logprobs still arrive
        for k, delta in enumerate(deltas):
            if lp is None and ("content" in delta or "reasoning_content" in delta):  # a token's text: the common chunk
                yield frame.event(choice(i, delta))
            else:
                yield chunk([choice(i, delta, lp if k == 0 else None)])
        if event.result is not None:
            answer = reasoning.split(event.result.generated_text)[1] if reasoning else event.result.generated_text
            called = splitters[i].is_call and parse_tool_call(answer) is not None
            yield chunk([choice(i, {}, finish=finish_reason(event.result, called))])
    if include_usage:
        yield chunk([], usage(admitted.streams, n))
    yield DONE


async def completion_chunks(gate: Gate, admitted: Admitted, meta: ResponseMeta, n: int, logprobs: bool, echo: bool,
                            include_usage: bool) -> AsyncIterator[bytes]:
    tokenizer = gate.engine.tokenizer
    offsets = [0] * len(admitted.streams)

    common = {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
              "system_fingerprint": meta.fingerprint, **({"usage": None} if include_usage else {})}
    frame = ChunkFrame(o.CompletionChunk, common)

    def chunk(choices: list[dict], usage: o.Usage | None = None) -> bytes:
        return _data(o.CompletionChunk.model_validate({**common, "choices": choices,
                                                       **({"usage": usage} if include_usage else {})}))

    if echo:
        for i, stream in enumerate(admitted.streams):
            offsets[i] = len(stream.request.inputs)
            yield chunk([{"index": i, "text": stream.request.inputs, "logprobs": None, "finish_reason": None}])
    async for i, event in gate.events(admitted):
        if isinstance(event, ErrorEvent):
            yield _error(event)
            return
        text = content_text(event.token, tokenizer)
        if logprobs:
            token = TokenOut(event.token.id, text, event.token.logprob, event.token.special)
            lp = completion_logprobs([token], [event.top_tokens], offsets[i])
            yield chunk([{"index": i, "text": text, "logprobs": lp, "finish_reason": None}])
        else:
            yield frame.event({"index": i, "text": text, "logprobs": None, "finish_reason": None})
        offsets[i] += len(text)
        if event.result is not None:
            yield chunk([{"index": i, "text": "", "logprobs": None,
                          "finish_reason": finish_reason(event.result, False)}])
    if include_usage:
        yield chunk([], usage(admitted.streams, n))
    yield DONE


def usage(streams: list[RequestStream], n: int) -> o.Usage:
    """Token counts of a finished response: each prompt once (its `n`
    choices are consecutive streams), every choice's generated tokens."""
    prompt = sum(s.request.input_length for s in streams[::n])
    completion = sum(len(s.best()[0].tokens) for s in streams)
    return o.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
