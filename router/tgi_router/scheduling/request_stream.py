"""One request's life after validation: its sequences (best_of of them),
text streaming, stop strings, timings, and the events its route reads."""

import asyncio
import time
from dataclasses import dataclass, field

from tgi_proto import pb
from tgi_router.request.validation import ValidGenerateRequest
from tgi_router.scheduling.sequence import FinishReason, Sequence
from tgi_router.text.detokenizer import IncrementalDetokenizer, decode_generated
from tgi_router.text.stop_strings import StopStringMatcher
from tgi_router.text.tokenizer import RouterTokenizer


@dataclass(frozen=True)
class TokenOut:
    id: int
    text: str
    logprob: float
    special: bool


@dataclass(frozen=True)
class SequenceResult:
    """A finished sequence: what /generate's details report."""
    generated_text: str
    finish_reason: FinishReason
    tokens: list[TokenOut]
    top_tokens: list[list[TokenOut]]
    prefill: list[TokenOut]   # logprob NaN for the first token
    seed: int | None

    @property
    def logprob_sum(self) -> float:
        return sum(t.logprob for t in self.tokens)


@dataclass(frozen=True)
class StreamEvent:
    """A generated token; `result` is set on the last one of the sequence."""
    token: TokenOut
    top_tokens: list[TokenOut]
    result: SequenceResult | None = None


@dataclass(frozen=True)
class ErrorEvent:
    message: str


@dataclass
class Timings:
    arrival: float
    validated: float = 0.0
    queued: float = 0.0
    first_scheduled: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    finished: float = 0.0


class SequenceText:
    """Per-sequence text state: incremental detokenizer and stop strings."""

    def __init__(self, tokenizer: RouterTokenizer, request: ValidGenerateRequest):
        self.detok = IncrementalDetokenizer(tokenizer, request.input_ids,
                                            special_ids=tokenizer.all_special_ids)
        self.stops = StopStringMatcher(request.stopping.stop_sequences)
        self.tokens: list[TokenOut] = []
        self.top_tokens: list[list[TokenOut]] = []
        self.prefill: list[TokenOut] = []


@dataclass
class RequestStream:
    """Created by the engine for each request; the route awaits `events`.
    The engine never waits for a route: `events` takes one event per
    generated token plus the end (or one error), so a client that reads
    slowly holds at most max_new_tokens + 1 events and stalls nobody else."""
    request: ValidGenerateRequest
    tokenizer: RouterTokenizer
    timings: Timings
    trace: object | None = None  # the request's tracing.RequestSpan; None when not traced
    sequences: list[Sequence] = field(default_factory=list)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    results: dict[int, SequenceResult] = field(default_factory=dict)

    def __post_init__(self):
        self._text: dict[int, SequenceText] = {}

    def text_of(self, seq: Sequence) -> SequenceText:
        if seq.id not in self._text:
            self._text[seq.id] = SequenceText(self.tokenizer, self.request)
        return self._text[seq.id]

    def token(self, token_id: int, logprob: float, text: str | None = None) -> TokenOut:
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return TokenOut(token_id, text, logprob, token_id in self.tokenizer.all_special_ids)

    def on_generation(self, seq: Sequence, gen: pb.Generation) -> None:
        """Records one step's prompt output of seq (its prompt logprobs)."""
        self.timings.first_scheduled = self.timings.first_scheduled or time.perf_counter()
        self.text_of(seq).prefill.extend(self.token(t.token_id, t.logprob) for t in gen.prefill_tokens)

    def on_token(self, seq: Sequence, sampled: pb.Generation | pb.NextToken) -> tuple[StreamEvent, bool]:
        """Records one generated token of seq (a Generation's first token or
        one of its next_tokens): (its event, whether a stop string matched)."""
        state = self.text_of(seq)
        now = time.perf_counter()
        text = state.detok.add(sampled.token_id)
        _, matched = state.stops.feed(text)
        token = self.token(sampled.token_id, sampled.logprob, text)
        top = [self.token(t.token_id, t.logprob) for t in sampled.top_tokens]
        state.tokens.append(token)
        state.top_tokens.append(top)
        self.timings.first_token = self.timings.first_token or now
        self.timings.last_token = now
        return StreamEvent(token, top), matched is not None

    def emit(self, seq: Sequence, event: StreamEvent, last: bool) -> None:
        """Queues a token's event; the sequence's last token's event (`last`)
        carries its result. best_of > 1 (never streamed) answers at the end."""
        if last:
            # The last token also carries text held back for incomplete UTF-8.
            tail = self.text_of(seq).detok.flush()
            token = TokenOut(event.token.id, event.token.text + tail, event.token.logprob, event.token.special)
            event = StreamEvent(token, event.top_tokens, self._finish(seq))
        if len(self.sequences) == 1:
            self.events.put_nowait(event)
        if len(self.results) == len(self.sequences):
            self.timings.finished = time.perf_counter()
            self.events.put_nowait(None)  # end of stream

    def _finish(self, seq: Sequence) -> SequenceResult:
        state = self.text_of(seq)
        result = SequenceResult(
            generated_text=decode_generated(self.tokenizer, self.request.input_ids, seq.generated_ids),
            finish_reason=seq.finish_reason, tokens=state.tokens, top_tokens=state.top_tokens,
            prefill=state.prefill,
            seed=seq.params.seed if seq.params.do_sample else None)
        self.results[seq.id] = result
        return result

    def fail(self, message: str) -> None:
        self.events.put_nowait(ErrorEvent(message))

    def best(self) -> tuple[SequenceResult, list[SequenceResult]]:
        """(the result with the highest total logprob, the others)."""
        ordered = [self.results[s.id] for s in self.sequences]
        best = max(ordered, key=lambda r: r.logprob_sum)
        return best, [r for r in ordered if r is not best]

    @property
    def generated_tokens(self) -> int:
        best, _ = self.best()
        return len(best.tokens)
