"""The step loop: schedule, run on the shards, apply the results, and (when
serving) stream each request's tokens to its route."""

import asyncio
import logging
import random
import time
from typing import NamedTuple

from tgi_proto import pb
from tgi_router.request.validation import ValidGenerateRequest
from tgi_router.scheduling.client import ShardClient, ShardError
from tgi_router.scheduling.request_stream import RequestStream, Timings
from tgi_router.scheduling.scheduler import ScheduledStep, Scheduler
from tgi_router.scheduling.sequence import FinishReason, Sequence, StoppingCriteria
from tgi_router.text.tokenizer import RouterTokenizer

log = logging.getLogger("tgi_router")

# How long an idle engine's first step waits for requests that arrived with
# the one that woke it and are still being validated (Engine.gather).
GATHER_S = 0.05


class _Sent(NamedTuple):
    """A step sent to the shards whose answer is not applied yet."""
    step: ScheduledStep
    request: pb.StepRequest
    call: asyncio.Future
    at: float  # perf_counter() when sent


class Engine:
    """Owns the scheduler; one `run` task drives the shards. `submit` adds a
    validated request and returns its stream; `cancel` ends it (its blocks
    are freed at once and the shards drop it on the next step).

    plan_ahead=False never sends a step before the previous one's answer is
    applied (benchmarks measure what async scheduling gains with it)."""

    def __init__(self, client: ShardClient, scheduler: Scheduler, tokenizer: RouterTokenizer | None = None,
                 eos_token_ids: tuple[int, ...] = (), metrics=None, plan_ahead: bool = True):
        self.client = client
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.metrics = metrics
        self.step_id = 0
        self.healthy = True
        self.tracing = False  # whether requests may carry a trace (--otlp-endpoint)
        self._streams: dict[int, RequestStream] = {}  # by sequence id
        self._next_id = 0
        self._wakeup = asyncio.Event()
        self._pending: tuple | None = None  # the last step and its response, not yet delivered
        self._inflight: _Sent | None = None
        self._answered = 0.0  # when the last answer was applied
        # Whether the shards set the pace (their step took at least half the
        # time between two answers): only then does planning ahead pay. When
        # the router is the slower side (a tiny model, many streams) the shard
        # idles either way, and steps sent ahead would only take the event
        # loop from the routes (writes, noticing clients that hung up).
        self._shard_bound = True
        self.plan_ahead = plan_ahead
        # Requests admitted and still being validated (templating, tokenizing:
        # off the event loop), counted by the routes' Gate; see `gather`.
        self.validating = 0

    # -- requests ------------------------------------------------------------
    def submit(self, request: ValidGenerateRequest, timings: Timings, trace=None) -> RequestStream:
        """trace: the request's tracing.RequestSpan, which gets a span per step it takes part in."""
        stream = RequestStream(request, self.tokenizer, timings, trace)
        rng = random.Random(request.parameters.seed)
        for i in range(request.best_of):
            # best_of copies draw fresh seeds, as TGI does; the first keeps the request's
            seed = request.parameters.seed if i == 0 else rng.getrandbits(63)
            self._next_id += 1
            seq = Sequence(id=self._next_id, token_ids=list(request.input_ids),
                           params=_sampling(request, seed), stopping=StoppingCriteria(
                               request.stopping.max_total_new_tokens, self.eos_token_ids,
                               request.stopping.ignore_eos_token), adapter=request.adapter)
            stream.sequences.append(seq)
            self._streams[seq.id] = stream
            self.scheduler.add(seq)
        timings.queued = time.perf_counter()
        self._wakeup.set()
        return stream

    def cancel(self, stream: RequestStream) -> None:
        for seq in stream.sequences:
            if seq.finish_reason is None:
                self.scheduler.finish(seq, FinishReason.CANCELLED)
            self._streams.pop(seq.id, None)
        self._wakeup.set()

    # -- the loop ------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """Nothing to schedule, release, deliver or await."""
        return (not self.scheduler.has_work() and not self.scheduler.pending_release
                and self._pending is None and self._inflight is None)

    async def step(self) -> list[Sequence]:
        """Applies one step's answer; returns the sequences that finished.

        Async scheduling: before awaiting a step's answer, the next step is
        planned and sent (`Scheduler.schedule_ahead`), so the shards start it
        as soon as they finish this one; the router's own work (applying
        answers, text, events) runs meanwhile. A step's tokens are turned
        into text and events while the next step runs on the shards, so a
        stop string ends its sequence a step late: the extra token is
        computed and dropped, as for an EOS seen after the next step was sent."""
        if self._inflight is None:
            step = self.scheduler.schedule()
            if not step.seqs:
                self._deliver_pending()
                # Work that the scheduler could not place now can never run; decide
                # before awaiting, while requests arriving meanwhile cannot count.
                if self.scheduler.has_work():
                    self._fail_unschedulable()
                release = step.release_ids + self.scheduler.take_releases()
                if release:
                    await self.client.release(release)
                if self.metrics is not None:
                    self._observe_state()  # cancelled requests' blocks are free now, whether or not a step follows
                return []
            self._inflight = self._send(step)
        sent, self._inflight = self._inflight, None
        step = sent.step
        # Planning ahead pays only while the shards compute: an answer already
        # back is applied first (no extra tokens, and the next await yields).
        ahead = (None if sent.call.done() or not (self._shard_bound and self.plan_ahead)
                 else self.scheduler.schedule_ahead(step))
        if ahead is not None:
            self._inflight = self._send(ahead, after=sent.request.step_id)
        # Every earlier answer is applied: whether this step computes prompt tokens shows now.
        method = "prefill" if any(seq.num_computed < seq.prompt_length for seq, _ in step.seqs) else "decode"
        try:
            try:
                self._deliver_pending()
            finally:
                response = await sent.call
        except BaseException as err:
            if self._inflight is not None:  # it cannot run without this step's answer applied
                self._inflight.call.cancel()
                self._inflight = None
            if self.metrics is not None and isinstance(err, (ShardError, OSError)):
                self.metrics.batch_failed(method)
            raise
        applying = time.perf_counter()
        finished = self.scheduler.update(step, response)
        filter_s = time.perf_counter() - applying
        self._pending = (step, response)
        if self._inflight is not None:
            self._deliver_pending()  # the next step is running: do the text work now
        now = time.perf_counter()
        if self.metrics is not None:
            self._observe(step, response, method, filter_s, now - max(sent.at, self._answered))
        if self.tracing:
            self._trace(step, sent, now)
        self._shard_bound = response.timings.total_ns / 1e9 >= 0.5 * (now - self._answered)
        self._answered = now
        return finished

    def _send(self, step: ScheduledStep, after: int = 0) -> _Sent:
        """Sends `step` to the shards, to run after step `after` (0: none)."""
        self.step_id += 1
        request = self.scheduler.to_request(step, self.step_id, after)
        if self.metrics is not None and request.new_sequences:
            self.metrics.next_batch(len(request.new_sequences))
            if self.scheduler.join_reason is not None:
                self.metrics.batch_concat(self.scheduler.join_reason)
        return _Sent(step, request, asyncio.ensure_future(self.client.step(request)), time.perf_counter())

    def _deliver_pending(self) -> None:
        if self._pending is None:
            return
        step, response = self._pending
        self._pending = None
        by_id = {g.id: g for g in response.generations}
        for seq, _ in step.seqs:
            stream = self._streams.get(seq.id)
            if stream is not None:
                self._deliver(stream, seq, by_id[seq.id])

    def _deliver(self, stream: RequestStream, seq: Sequence, gen: pb.Generation) -> None:
        """Streams the tokens of gen that seq kept (update drops those after
        an end), one event each; a stop string ends seq at its token."""
        stream.on_generation(seq, gen)
        if not gen.sampled:
            return
        delivered = len(stream.text_of(seq).tokens)
        for sampled in (gen, *gen.next_tokens):
            if delivered == seq.num_generated:
                break
            event, stop_matched = stream.on_token(seq, sampled)
            delivered += 1
            if stop_matched and seq.finish_reason is None:
                self.scheduler.finish(seq, FinishReason.STOP_SEQUENCE)
                del seq.token_ids[seq.prompt_length + delivered:]  # accepted drafts past the stop
            stream.emit(seq, event, last=seq.finish_reason is not None and delivered == seq.num_generated)
        if seq.finish_reason is not None:
            del self._streams[seq.id]

    def _fail_unschedulable(self) -> None:
        """Nothing runs and the head of the queue cannot get its blocks: it
        can never run (validation bounds requests by the KV cache, so this
        only guards against a mis-sized cache)."""
        seq = self.scheduler.waiting[0]
        stream = self._streams.get(seq.id)
        self.scheduler.finish(seq, FinishReason.CANCELLED)
        if stream is not None:
            stream.fail("Request needs more KV cache than the server has")
            self.cancel(stream)

    def _observe(self, step: ScheduledStep, response: pb.StepResponse, method: str, filter_s: float,
                 seconds: float) -> None:
        t = response.timings
        self.metrics.batch_step(method, forward_s=t.forward_ns / 1e9, decode_s=t.sample_ns / 1e9,
                                filter_s=filter_s, inference_s=seconds, size=len(step.seqs),
                                max_tokens=sum(len(s.token_ids) for s, _ in step.seqs))
        self._observe_state()
        stats = self.scheduler.take_stats()
        self.metrics.prefix_cache(stats.queried_tokens, stats.hit_tokens)
        for chunks in stats.prefill_chunks:
            self.metrics.prefill_chunks(chunks)
        policy = self.scheduler.speculation
        if policy is not None:
            gens = [g for g in response.generations if g.sampled]
            self.metrics.speculated([len(g.next_tokens) for g in gens], sum(g.num_drafted for g in gens),
                                    sum(len(g.next_tokens) for g in gens), policy.acceptance_rate)

    def _trace(self, step: ScheduledStep, sent: _Sent, answered: float) -> None:
        """A span per traced request of the step, from its sending to its answer applied."""
        for seq, tokens in step.seqs:
            stream = self._streams.get(seq.id)
            if stream is not None and stream.trace is not None:
                stream.trace.child("step", sent.at, answered, step_id=sent.request.step_id,
                                   batch_size=len(step.seqs), tokens=tokens)

    def _observe_state(self) -> None:
        bm = self.scheduler.blocks
        self.metrics.kv_blocks(bm.num_blocks, bm.num_used, bm.num_available, bm.num_cached)
        self.metrics.queue_size(len(self.scheduler.waiting))

    async def run_forever(self) -> None:
        """Serves until cancelled; a shard failure fails every request in
        flight and marks the engine unhealthy."""
        while True:
            if self.idle:
                self._wakeup.clear()
                await self._wakeup.wait()
                await self.gather()
            try:
                await self.step()
            except (ShardError, OSError) as err:
                log.error("step failed: %s", err)
                self.fail_all(f"Request failed during generation: Server error: {err}")
                self.healthy = False
                return
            await asyncio.sleep(0)  # let routes read their events between steps

    async def gather(self) -> None:
        """Before the first step after idling: waits, at most GATHER_S, while
        requests that came in with the one that woke the engine are still
        being validated, so that a burst starts in one step. Otherwise the
        first few requests of a burst get a step of their own and then decode
        through the steps that prefill the rest, and those stalls can set the
        inter-token p99 (figures: docs/tuning.md#burst-gathering). A lone
        request finds nothing being validated and does not wait."""
        deadline = time.perf_counter() + GATHER_S
        while self.validating and time.perf_counter() < deadline:
            await asyncio.sleep(0.001)

    def fail_all(self, message: str) -> None:
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream.fail(message)
            self.cancel(stream)


def _sampling(request: ValidGenerateRequest, seed: int) -> pb.SamplingParameters:
    p = request.parameters
    return pb.SamplingParameters(
        do_sample=p.do_sample, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
        typical_p=p.typical_p, repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty, seed=seed,
        top_n_tokens=request.top_n_tokens, prefill_logprobs=request.decoder_input_details,
        grammar=p.grammar.text if p.grammar is not None else "", watermark=p.watermark,
        max_new_tokens=request.stopping.max_total_new_tokens)
