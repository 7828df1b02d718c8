"""Per-sequence state a shard keeps between steps, updated from the router's
messages: new sequences arrive in full, running ones as differences."""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tgi_proto import pb

from .sampling.grammar import GrammarCompiler, GrammarError, SequenceGrammar
from .sampling.sampler import SamplingParams
from .speculation.ngram import NgramIndex


class StepError(ValueError):
    """The router sent a step this shard cannot run (unknown id, missing
    blocks, more tokens than remain); reported as INVALID_ARGUMENT."""


@dataclass
class ShardSequence:
    id: int
    token_ids: list[int]        # prompt then generated tokens, as the router knows them
    prompt_length: int
    num_computed: int           # tokens whose K/V is in the cache
    block_table: list[int]
    params: SamplingParams
    prefill_logprobs: bool
    scheduled: int = field(default=0)  # tokens to compute in the current step
    adapter: int = 0  # 0: the base model; i > 0: the i-th LoRA adapter loaded
    # Constrained decoding: the grammar's state after this sequence's generated
    # tokens (it consumes each sampled token); None: unconstrained.
    grammar: SequenceGrammar | None = None
    # Rank 0: the tokens sampled by the last step that computed this sequence
    # (one, or more when drafts were accepted), appended to token_ids when the
    # sequence is next scheduled; None: none.
    sampled: list[int] | None = None
    max_new_tokens: int = 0     # the most tokens it may generate (0: unknown)
    constrained: bool = False   # it has a grammar (on every rank; only rank 0 compiles it)
    # Speculation: the most drafts the current step may add (set by apply);
    # the drafts at the end of token_ids, computed by the current (or last)
    # step and settled when the sequence is next scheduled; the n-gram index
    # that proposes them (built on the first draft); and, with a draft model,
    # how many leading positions hold the draft model's K/V.
    draft_limit: int = 0
    drafted: int = 0
    ngram: NgramIndex | None = None
    draft_computed: int = 0
    # With Medusa heads: the normed hidden states [1 + drafts, hidden] of the
    # rows that sampled in this sequence's last step, and how many tokens it
    # kept (the last kept one's row drafts next).
    medusa_rows: torch.Tensor | None = None
    last_kept: int = 0

    @property
    def samples_this_step(self) -> bool:
        """Whether the current step reaches the last known token."""
        return self.num_computed + self.scheduled == len(self.token_ids)

    @property
    def drafts(self) -> list[int]:
        """The drafts at the end of token_ids (a copy)."""
        return self.token_ids[len(self.token_ids) - self.drafted:]

    def rejected(self, kept: int) -> int:
        """How many of the last step's drafts were rejected when it kept `kept`
        tokens (the accepted drafts and the token after them)."""
        return self.drafted - (kept - 1) if self.drafted else 0

    def settle(self, sampled: list[int]) -> None:
        """Replaces the last step's drafts by what it sampled: the accepted
        drafts and the token after them (all of `sampled`); num_computed
        keeps the known token and the accepted drafts only, and the draft
        model's K/V stays valid up to the last accepted draft it read."""
        known = len(self.token_ids) - self.drafted
        if self.drafted:
            del self.token_ids[known:]
            self.num_computed -= self.rejected(len(sampled))
            self.drafted = 0
        self.draft_computed = min(self.draft_computed, known + max(0, len(sampled) - 1))
        self.last_kept = len(sampled)
        self.token_ids.extend(sampled)

    def allow_drafts(self, limit: int) -> None:
        """Lets the current step draft up to `limit` tokens, fewer where the
        drafts and the token after them would pass max_new_tokens."""
        if self.max_new_tokens:
            limit = min(limit, self.max_new_tokens - (len(self.token_ids) - self.prompt_length) - 1)
        self.draft_limit = max(0, limit)

    def add_drafts(self, drafts: list[int]) -> None:
        """Appends drafts after the last token (which the step computes): the
        step then computes and checks them too."""
        self.token_ids.extend(drafts)
        self.drafted += len(drafts)
        self.scheduled += len(drafts)

    def drop_drafts(self, n: int) -> None:
        """Takes back the last n drafts (before the step runs)."""
        if n > 0:
            del self.token_ids[len(self.token_ids) - n:]
            self.drafted -= n
            self.scheduled -= n

    def ngram_drafts(self) -> list[int]:
        """Up to draft_limit drafts by n-gram lookup in the sequence's own tokens."""
        if self.ngram is None:
            self.ngram = NgramIndex()
        return self.ngram.propose(self.token_ids, self.draft_limit)


def params_from_proto(p: pb.SamplingParameters) -> SamplingParams:
    """Zero values mean "off" on the wire (an empty message is greedy)."""
    return SamplingParams(
        do_sample=p.do_sample, temperature=p.temperature or 1.0, top_k=p.top_k, top_p=p.top_p or 1.0,
        typical_p=p.typical_p or 1.0, min_p=p.min_p, repetition_penalty=p.repetition_penalty or 1.0,
        frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
        seed=p.seed, top_n_tokens=p.top_n_tokens, watermark=p.watermark)


@dataclass(frozen=True, slots=True)
class StagedSequence:
    """What a validated step does to one scheduled sequence; the table applies
    it only once every rank has agreed to run the step."""

    seq: ShardSequence
    tokens: list[int]  # to append: a running sequence's sampled tokens, a new one's token ids
    blocks: list[int]  # block ids to append to its block table
    scheduled: int     # tokens the step computes
    draft_limit: int   # the most drafts the step may add (0: none)


def _alone(ok: bool) -> bool:
    return ok


class SequenceTable:
    """All live sequences of this shard, by id.

    `grammars` compiles the grammars of new sequences; None (a shard without a
    tokenizer) refuses them. is_sampling_rank=False (tensor-parallel ranks > 0,
    which never sample) ignores grammars: rank 0 alone compiles and checks them."""

    def __init__(self, block_size: int, num_blocks: int, vocab_size: int,
                 grammars: GrammarCompiler | None = None, is_sampling_rank: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.vocab_size = vocab_size
        self.grammars = grammars
        self.is_sampling_rank = is_sampling_rank
        self._seqs: dict[int, ShardSequence] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def release(self, ids) -> int:
        return sum(self._seqs.pop(i, None) is not None for i in ids)

    def clear(self) -> None:
        self._seqs.clear()

    def apply(self, request: pb.StepRequest, agree: Callable[[bool], bool] = _alone,
              share: Callable[[list[int]], list[int]] | None = None) -> list[ShardSequence]:
        """Applies releases, new sequences and deltas (each running sequence
        first takes the tokens it sampled last, if any, in place of its
        drafts); returns the scheduled sequences (running, then new, in
        request order) with `scheduled` set.

        With `share` (tensor parallelism), first calls `share(values)` exactly
        once with this rank's sampled tokens per running sequence
        (`_sampled`'s layout): it returns rank 0's, so that every rank of the
        group appends the tokens rank 0 sampled; None: one rank, its own.
        Each sequence's draft_limit says how many drafts the step may add
        (the caller proposes them, from the same tokens on every rank).
        Then validates everything before changing anything but the
        releases, and calls `agree(valid)` exactly once: it answers whether
        every rank found the step valid (rank 0 alone checks grammars), so
        that all ranks run the step or none does."""
        if share is None:
            sampled = [self._own_sampled(r.id) for r in request.running]
        else:
            sampled = self._unpack(share([v for r in request.running for v in self._sampled(r.id)]),
                                   request.running)
        try:
            staged = self._stage(request, sampled)
        except Exception:
            agree(False)
            raise
        if not agree(True):
            raise StepError("another shard rejected the step")
        scheduled_seqs = []
        for change in staged:
            seq = change.seq
            seq.sampled = None
            seq.settle(change.tokens)
            seq.block_table.extend(change.blocks)
            seq.scheduled = change.scheduled
            seq.draft_limit = 0
            if change.draft_limit and change.scheduled == 1 and seq.samples_this_step:
                seq.allow_drafts(change.draft_limit)
            self._seqs[seq.id] = seq
            scheduled_seqs.append(seq)
        return scheduled_seqs

    def _own_sampled(self, seq_id: int) -> list[int]:
        seq = self._seqs.get(seq_id)
        return [] if seq is None or seq.sampled is None else seq.sampled

    def _sampled(self, seq_id: int) -> list[int]:
        """A running sequence's slot in the shared values: 2 + its drafts of
        the last step long (a width every rank knows), holding how many
        tokens it sampled, then those tokens (-1 where none)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return [0, -1]
        slot = [0] + [-1] * (1 + seq.drafted)
        if seq.sampled is not None:
            slot[0] = len(seq.sampled)
            slot[1:1 + len(seq.sampled)] = seq.sampled
        return slot

    def _unpack(self, values: list[int], running) -> list[list[int]]:
        """Per running sequence, the tokens it sampled (`_sampled`'s slots)."""
        out, i = [], 0
        for r in running:
            seq = self._seqs.get(r.id)
            width = 2 + (seq.drafted if seq is not None else 0)
            out.append(values[i + 1:i + 1 + values[i]])
            i += width
        return out

    def _stage(self, request: pb.StepRequest, sampled: list[list[int]]) -> list[StagedSequence]:
        """Validates the request and applies its releases; returns what the
        step does to each scheduled sequence (running, then new)."""
        seen: set[int] = set()
        for r in request.running:
            if r.id not in self._seqs or r.id in request.release_ids:
                raise StepError(f"running sequence {r.id} is unknown to the shard")
            seen.add(r.id)
        for n in request.new_sequences:
            if n.id in seen or (n.id in self._seqs and n.id not in request.release_ids):
                raise StepError(f"sequence {n.id} is already live")
            seen.add(n.id)
        self.release(request.release_ids)
        staged = ([self._delta(r, t) for r, t in zip(request.running, sampled)]
                  + [self._new(n) for n in request.new_sequences])
        for change in staged:
            seq, tokens = change.seq, change.tokens
            # As the sequence will be once the last step's drafts are settled.
            computed = seq.num_computed - seq.rejected(len(tokens))
            self._check(seq.id, computed, len(seq.token_ids) - seq.drafted + len(tokens),
                        len(seq.block_table) + len(change.blocks), change.scheduled, change.draft_limit,
                        change.blocks)
            if tokens and max(tokens) >= self.vocab_size:
                raise StepError(f"sequence {seq.id}: token id {max(tokens)} is outside the "
                                f"vocabulary (size {self.vocab_size})")
        # Grammars compile only once the tokens they consume are known to be valid.
        for change, n in zip(staged[len(request.running):], request.new_sequences):
            if n.parameters.grammar and self.is_sampling_rank:
                seq = change.seq
                seq.grammar = self._grammar(seq.id, n.parameters, change.tokens[seq.prompt_length:])
        return staged

    def _delta(self, r: pb.RunningSequence, sampled: list[int]) -> StagedSequence:
        seq = self._seqs[r.id]
        if seq.drafted and not sampled:
            raise StepError(f"sequence {r.id}: its drafts were never checked")
        return StagedSequence(seq, sampled, list(r.new_block_ids), r.num_scheduled_tokens, r.num_draft_tokens)

    def _new(self, n: pb.NewSequence) -> StagedSequence:
        seq = ShardSequence(
            id=n.id, token_ids=[], prompt_length=n.prompt_length or len(n.token_ids),
            num_computed=n.num_computed_tokens, block_table=[],
            params=params_from_proto(n.parameters), prefill_logprobs=n.parameters.prefill_logprobs,
            adapter=n.adapter, max_new_tokens=n.parameters.max_new_tokens,
            constrained=bool(n.parameters.grammar), draft_computed=n.num_computed_tokens)
        return StagedSequence(seq, list(n.token_ids), list(n.block_table), n.num_scheduled_tokens, draft_limit=0)

    def _grammar(self, seq_id: int, p: pb.SamplingParameters, generated: list[int]) -> SequenceGrammar:
        """The grammar's state after `generated` (a re-sent preempted sequence's tokens)."""
        if self.grammars is None:
            raise StepError(f"sequence {seq_id}: this shard has no tokenizer, so it cannot apply a grammar")
        try:
            return self.grammars.start(seq_id, p.grammar, generated, p.max_new_tokens, greedy=not p.do_sample)
        except GrammarError as err:
            raise StepError(f"sequence {seq_id}: {err}") from None

    def _check(self, seq_id: int, computed: int, total: int, blocks: int, scheduled: int, drafts: int,
               new_blocks: list[int]) -> None:
        if scheduled < 1 or computed + scheduled > total:
            raise StepError(f"sequence {seq_id}: {scheduled} tokens scheduled but "
                            f"{total - computed} remain to compute")
        if blocks * self.block_size < computed + scheduled + drafts:
            raise StepError(f"sequence {seq_id}: {blocks} blocks cannot hold "
                            f"{computed + scheduled + drafts} tokens")
        if any(b >= self.num_blocks for b in new_blocks):
            raise StepError(f"sequence {seq_id}: block id out of range (num_blocks={self.num_blocks})")

    def advance(self, seqs: list[ShardSequence]) -> None:
        """After a successful forward: the scheduled tokens are now cached."""
        for seq in seqs:
            seq.num_computed += seq.scheduled
            seq.scheduled = 0
