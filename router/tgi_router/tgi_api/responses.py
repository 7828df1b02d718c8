"""Builds TGI's JSON answers and headers from a finished RequestStream."""

import math

from tgi_router.request import protocol as p
from tgi_router.scheduling.request_stream import RequestStream, SequenceResult, StreamEvent, TokenOut
from tgi_router.web.sse import compact_json


def token(t: TokenOut) -> p.Token:
    return p.Token(id=t.id, text=t.text, logprob=t.logprob, special=t.special)


def _prefill(result: SequenceResult) -> list[p.PrefillToken]:
    return [p.PrefillToken(id=t.id, text=t.text, logprob=None if math.isnan(t.logprob) else t.logprob)
            for t in result.prefill]


def generated_text(stream: RequestStream, result: SequenceResult, full_text_default: bool) -> str:
    full = stream.request.return_full_text
    if full if full is not None else full_text_default:
        return stream.request.inputs + result.generated_text
    return result.generated_text


def generate_response(stream: RequestStream, full_text_default: bool = False) -> p.GenerateResponse:
    best, others = stream.best()
    details = None
    if stream.request.details or stream.request.decoder_input_details:
        details = p.Details(
            finish_reason=best.finish_reason.value, generated_tokens=len(best.tokens), seed=best.seed,
            prefill=_prefill(best) if stream.request.decoder_input_details else [],
            tokens=[token(t) for t in best.tokens],
            top_tokens=[[token(t) for t in top] for top in best.top_tokens] if stream.request.top_n_tokens else [],
            best_of_sequences=[p.BestOfSequence(
                generated_text=generated_text(stream, r, full_text_default), finish_reason=r.finish_reason.value,
                generated_tokens=len(r.tokens), seed=r.seed,
                prefill=_prefill(r) if stream.request.decoder_input_details else [],
                tokens=[token(t) for t in r.tokens],
                top_tokens=[[token(t) for t in top] for top in r.top_tokens] if stream.request.top_n_tokens else [])
                for r in others] or None)
    return p.GenerateResponse(generated_text=generated_text(stream, best, full_text_default), details=details)


def stream_response(stream: RequestStream, event: StreamEvent, index: int) -> p.StreamResponse:
    """One SSE event; the last token carries generated_text (and details)."""
    result = event.result
    details = None
    if result is not None and stream.request.details:
        details = p.StreamDetails(finish_reason=result.finish_reason.value, generated_tokens=len(result.tokens),
                                  seed=result.seed, input_length=stream.request.input_length)
    return p.StreamResponse(
        index=index, token=token(event.token), top_tokens=[token(t) for t in event.top_tokens],
        generated_text=generated_text(stream, result, False) if result is not None else None, details=details)


def stream_token_event(event: StreamEvent, index: int) -> bytes | None:
    """The SSE event of a token that is not its sequence's last and has no
    top tokens, as `stream_response` writes it (None for any other event):
    built without models, the per-token work of a stream."""
    if event.result is not None or event.top_tokens:
        return None
    t = event.token
    logprob = t.logprob if math.isfinite(t.logprob) else None
    return b"data:" + compact_json({
        "index": index, "token": {"id": t.id, "text": t.text, "logprob": logprob, "special": t.special},
        "generated_text": None, "details": None}) + b"\n\n"


def timing_headers(stream: RequestStream, compute_type: str) -> dict[str, str]:
    """TGI's x-* headers, in milliseconds."""
    t = stream.timings
    generated = max(stream.generated_tokens, 1)
    inference = t.finished - (t.first_scheduled or t.queued)

    def ms(seconds: float) -> str:
        return str(max(0, round(seconds * 1000)))
    return {
        "x-compute-type": compute_type,
        "x-compute-time": f"{t.finished - t.arrival:.6f}",
        "x-compute-characters": str(len(stream.request.inputs)),
        "x-total-time": ms(t.finished - t.arrival),
        "x-validation-time": ms(t.validated - t.arrival),
        "x-queue-time": ms((t.first_scheduled or t.queued) - t.queued),
        "x-inference-time": ms(inference),
        "x-time-per-token": ms(inference / generated),
        "x-prompt-tokens": str(stream.request.input_length),
        "x-generated-tokens": str(stream.generated_tokens),
    }
