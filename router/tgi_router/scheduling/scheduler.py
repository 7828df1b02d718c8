"""Continuous batching under a token budget, with no prefill or decode
phase: each step gives running sequences their tokens first, then admits
waiting ones while the budget and free blocks allow. A prompt longer than
the budget left is computed in chunks over several steps. When blocks run
out, the most recently admitted sequence is preempted (its blocks freed, to
be recomputed later from its tokens): never a crash or a stall.

With prefix caching, an admitted sequence first takes the cached blocks of
its longest cached prefix (whole blocks, always leaving the block of its last
token to compute, so the shard samples and never writes a shared block) and
starts computing after them; every block a step fills is registered for
later sequences. A waiting sequence whose next block is being filled in this
very step (best_of copies, a burst sharing a system prompt, a chunked prompt
it shares) waits one step to hit it instead of computing it twice.

Async scheduling: `schedule_ahead` plans the step after one whose answer
has not come back, so that the shards never wait for the router. A sequence
that samples in the step in flight gets one token (the unknown one the shard
sampled) unless that token is its last by length; a sequence that turns out
to have ended in that step (EOS, stop string) has the extra token computed
and dropped. It never preempts: when blocks are short it plans nothing and
the caller applies the step in flight, then calls `schedule`."""

from collections import deque
from dataclasses import dataclass, field

from tgi_proto import pb
from tgi_router.scheduling.block_manager import BlockManager, chain_hashes
from tgi_router.scheduling.sequence import FinishReason, Sequence, Status
from tgi_router.scheduling.speculation import SpeculationPolicy
from tgi_router.scheduling.step_budget import StepBudget
from tgi_router.scheduling.step_pacer import StepPacer


@dataclass(frozen=True)
class ScheduledStep:
    seqs: list[tuple[Sequence, int]]   # (sequence, tokens to compute incl. drafts), running first
    release_ids: list[int]             # sequences the shards should drop first
    drafts: dict[int, int] = field(default_factory=dict)  # sequence id -> draft tokens allowed (speculation)


@dataclass
class PrefillStats:
    """Counts since the last `Scheduler.take_stats()`."""
    queried_tokens: int = 0   # tokens of admitted sequences looked up in the prefix cache
    hit_tokens: int = 0       # of those, tokens found cached (not computed)
    prefill_chunks: list[int] = field(default_factory=list)  # steps each completed prefill took


class Scheduler:
    """max_batch_tokens: tokens computed per step (--max-batch-prefill-tokens).
    waiting_served_ratio / max_waiting_tokens keep TGI's meaning: while
    sequences run, waiting ones join only when they number at least
    ratio x running, or when max_waiting_tokens steps passed since the last
    join. With a `pacer`, prompt tokens in a step where sequences decode are
    bounded by its `prompt_cap` (running prompts' chunks and newcomers
    alike), and a join that the bound cuts short goes on over the next steps
    until the queue is in, whatever the ratio says meanwhile.

    With `speculation`, decoding sequences may draft tokens that the shards
    check in the same step (SpeculationPolicy says how many): drafts count
    against the step's budget after the running sequences' own tokens and
    before newcomers', and get blocks only where free ones are left (a
    draft never preempts). Accepted drafts advance num_computed like any
    computed token; rejected ones leave no trace."""

    def __init__(self, blocks: BlockManager, max_batch_tokens: int, max_batch_size: int = 0,
                 waiting_served_ratio: float = 0.0, max_waiting_tokens: int = 0, pacer: StepPacer | None = None,
                 speculation: SpeculationPolicy | None = None):
        self.blocks = blocks
        self.pacer = pacer
        self.speculation = speculation
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size or 1 << 30
        self.waiting_served_ratio = waiting_served_ratio
        self.max_waiting_tokens = max_waiting_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._to_release: list[int] = []
        self._steps_since_join = 0
        self.num_preemptions = 0
        # Why the last step's newcomers joined running sequences (TGI's
        # tgi_batch_concat reasons), or None when they started a batch.
        self.join_reason: str | None = None
        self._stats = PrefillStats()
        self._prefilling: dict[int, int] = {}  # sequence id -> steps of its current prefill so far
        self._joining = False  # a join the pacer cut short, to go on next step

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def pending_release(self) -> bool:
        return bool(self._to_release)

    def schedule(self) -> ScheduledStep:
        budget = StepBudget(self.max_batch_tokens,
                            self._prompt_allowance(sum(1 for seq in self.running if seq.remaining == 1)))
        chosen: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or len(chosen) >= self.max_batch_size:
                continue  # preempted by an earlier one in this loop, or no room this step
            n = budget.offer(seq.remaining)
            if n == 0:
                continue
            while not self._grow(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                chosen.append((seq, n))
                budget.take(seq.remaining, n)
        drafts = self._drafts([(seq, seq.num_generated) for seq, n in chosen if seq.remaining == 1], budget.tokens)
        for seq, _ in chosen:
            if seq.id in drafts and not self._grow(seq, 1 + drafts[seq.id]):
                del drafts[seq.id]  # no free blocks for them: it decodes without
        chosen = [(seq, n + drafts.get(seq.id, 0)) for seq, n in chosen]
        budget.tokens -= sum(drafts.values())
        if self._may_join(len(chosen)):
            pending = {h for seq, n in chosen for h in self._filled_hashes(seq, seq.num_computed, n)}
            self._admit(chosen, budget, pending)
        self._steps_since_join += 1
        return ScheduledStep(chosen, self.take_releases(), drafts)

    def schedule_ahead(self, inflight: ScheduledStep) -> ScheduledStep | None:
        """The step after `inflight`, sent before `update(inflight)`: running
        sequences as they will be once it has run, then newcomers; None when
        nothing can run or a running sequence lacks blocks (no preemption
        here: apply `inflight` first, then `schedule()`)."""
        # n counts drafts: a sequence with drafts in flight gets room for all of them being accepted.
        ahead = {seq.id: n for seq, n in inflight.seqs}
        wanted: list[tuple[Sequence, int, int]] = []  # (sequence, tokens it needs, computed before them)
        for seq in self.running:
            computed = seq.num_computed + ahead.get(seq.id, 0)
            remaining = len(seq.token_ids) - computed
            if remaining <= 0:  # it samples in the step in flight (-drafts when it has drafts)
                if seq.num_generated + 1 >= seq.stopping.max_new_tokens:
                    continue  # that token is its last
                remaining = 1
            wanted.append((seq, remaining, computed))
        budget = StepBudget(self.max_batch_tokens,
                            self._prompt_allowance(sum(1 for _, remaining, _ in wanted if remaining == 1)))
        plan: list[tuple[Sequence, int, int]] = []  # (sequence, tokens to compute, computed before them)
        for seq, remaining, computed in wanted:
            if len(plan) >= self.max_batch_size:
                break
            n = budget.offer(remaining)
            if n == 0:
                continue
            plan.append((seq, n, computed))
            budget.take(remaining, n)
        # Generated tokens once the step in flight has run: at least one more when it samples.
        drafts = self._drafts([(seq, seq.num_generated + (len(seq.token_ids) <= c)) for seq, n, c in plan
                               if n == 1 and len(seq.token_ids) - c <= 1], budget.tokens)
        with_drafts = [(seq, n + drafts.get(seq.id, 0), c) for seq, n, c in plan]
        missing = [self.blocks.blocks_for(c + n) - len(seq.block_table) for seq, n, c in with_drafts]
        if drafts and sum(m for m in missing if m > 0) > self.blocks.num_available:
            drafts, with_drafts = {}, plan  # blocks are short: no drafts rather than no step
            missing = [self.blocks.blocks_for(c + n) - len(seq.block_table) for seq, n, c in plan]
        plan = with_drafts
        if sum(m for m in missing if m > 0) > self.blocks.num_available:
            return None
        for (seq, _, _), m in zip(plan, missing):
            if m > 0:
                seq.block_table.extend(self.blocks.allocate(m))
        chosen = [(seq, n) for seq, n, _ in plan]
        budget.tokens -= sum(drafts.values())
        if self._may_join(len(chosen)):
            # Blocks the step in flight fills are not registered yet: a
            # newcomer that could hit them waits, as for this step's own.
            pending = {h for seq, n in inflight.seqs if seq.status is Status.RUNNING
                       for h in self._filled_hashes(seq, seq.num_computed, n)}
            pending.update(h for seq, n, c in plan for h in self._filled_hashes(seq, c, n))
            self._admit(chosen, budget, pending)
        if not chosen:
            return None
        self._steps_since_join += 1
        return ScheduledStep(chosen, self.take_releases(), drafts)

    def _drafts(self, decoding: list[tuple[Sequence, int]], budget: int) -> dict[int, int]:
        """Draft tokens for the (sequence, tokens it will have generated) that
        decode in a step, within `budget` tokens: the policy's count, less
        what would pass the sequence's max_new_tokens."""
        if self.speculation is None or not decoding:
            return {}
        allowed = self.speculation.drafts([seq for seq, _ in decoding], len(decoding))
        out = {}
        for seq, generated in decoding:
            k = min(allowed.get(seq.id, 0), seq.stopping.max_new_tokens - generated - 1, budget)
            if k > 0:
                out[seq.id] = k
                budget -= k
        return out

    def take_stats(self) -> PrefillStats:
        """Prefix-cache and chunking counts since the last call."""
        stats, self._stats = self._stats, PrefillStats()
        return stats

    def take_releases(self) -> list[int]:
        """Ids the shards must drop, handed out once."""
        release, self._to_release = self._to_release, []
        return release

    def _prompt_allowance(self, decodes: int) -> int:
        """Prompt tokens a step with `decodes` decoding sequences may compute:
        the pacer's cap, else the whole budget."""
        cap = None
        if self.pacer is not None:
            batch = min(len(self.running) + len(self.waiting), self.max_batch_size)
            cap = self.pacer.prompt_cap(decodes, batch)
        return self.max_batch_tokens if cap is None else min(cap, self.max_batch_tokens)

    def _may_join(self, running: int) -> bool:
        if self._joining and self.waiting:
            return True  # a join cut short by the pacer, with its reason
        self.join_reason = None
        if not self.waiting or not running:
            return bool(self.waiting)
        if self._steps_since_join >= self.max_waiting_tokens:
            self.join_reason = "wait_exceeded"
            return True
        self.join_reason = "backpressure"
        return len(self.waiting) >= int(running * self.waiting_served_ratio)

    def _admit(self, chosen: list[tuple[Sequence, int]], left: StepBudget, pending: set[int]) -> None:
        """Admits waiting sequences into `chosen` while the step's budget
        `left` and blocks last (every newcomer token counts as a prompt
        token); `pending`: prefix hashes of blocks being filled (by `chosen`
        or a step in flight), extended with the newcomers'."""
        caching = self.blocks.prefix_caching
        paced = left.prompt < left.tokens
        budget = min(left.tokens, left.prompt)
        joined = False
        for seq in list(self.waiting):
            if budget == 0 or len(chosen) >= self.max_batch_size:
                break
            hit = self._cached_prefix(seq)
            if self._next_block_pending(seq, hit, pending):
                continue  # hit it next step rather than compute it twice now
            n = self._start(seq, hit, budget)
            if n is None:
                break  # first come, first served: do not let later ones overtake
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            chosen.append((seq, n))
            budget -= n
            joined = True
            self._prefilling[seq.id] = 0
            if caching:
                pending.update(self._filled_hashes(seq, seq.num_computed, n))
        if joined:
            self._steps_since_join = 0
        self._joining = paced and budget == 0 and bool(self.waiting)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks of seq's longest cached prefix, stopping before the
        block of its last token; none when seq wants prompt logprobs (they
        come from computing the prompt). Leaves seq.block_hashes covering
        every block that could have hit."""
        if not self.blocks.prefix_caching or seq.params.prefill_logprobs:
            return []
        reusable = (len(seq.token_ids) - 1) // self.blocks.block_size
        chain_hashes(seq.token_ids, self.blocks.block_size, seq.block_hashes, reusable, seq.hash_root)
        return self.blocks.lookup(seq.block_hashes[:reusable])

    def _next_block_pending(self, seq: Sequence, hit: list[int], pending: set[int]) -> bool:
        """Whether the block after seq's cached prefix, one it could reuse,
        is being filled in this step (by a sequence chosen before it)."""
        if not pending or seq.params.prefill_logprobs:
            return False
        reusable = (len(seq.token_ids) - 1) // self.blocks.block_size
        return len(hit) < reusable and seq.block_hashes[len(hit)] in pending

    def _start(self, seq: Sequence, hit: list[int], budget: int) -> int | None:
        """Gives a waiting seq the `hit` blocks and room for its first chunk;
        returns the chunk's length, or None (and seq untouched) when blocks
        are short."""
        self.blocks.share(hit)
        seq.block_table = list(hit)
        seq.num_computed = len(hit) * self.blocks.block_size
        n = min(seq.remaining, budget)
        if not self._grow(seq, n):
            self.blocks.free(hit)
            seq.block_table, seq.num_computed = [], 0
            return None
        if self.blocks.prefix_caching and not seq.params.prefill_logprobs:
            self._stats.queried_tokens += len(seq.token_ids)
            self._stats.hit_tokens += seq.num_computed
        return n

    def _filled_hashes(self, seq: Sequence, start: int, n: int) -> list[int]:
        """Prefix hashes of the blocks that computing tokens start..start+n-1
        of seq fills, as far as its tokens are known (a token sampled in a
        step in flight is not)."""
        if not self.blocks.prefix_caching:
            return []
        bs = self.blocks.block_size
        first, full = start // bs, min(start + n, len(seq.token_ids)) // bs
        chain_hashes(seq.token_ids, bs, seq.block_hashes, full, seq.hash_root)
        return seq.block_hashes[first:full]

    def _preempt(self, seq: Sequence) -> None:
        """Frees seq's blocks and puts it first in line; it is recomputed from
        its tokens (prompt and generated so far) when blocks free up."""
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        self._prefilling.pop(seq.id, None)
        if seq.on_shard:
            self._to_release.append(seq.id)
        seq.block_table = []
        seq.num_computed = 0
        seq.on_shard, seq.shard_blocks = False, 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _grow(self, seq: Sequence, n: int) -> bool:
        """Makes seq's block table cover computed + n tokens."""
        missing = self.blocks.blocks_for(seq.num_computed + n) - len(seq.block_table)
        if missing <= 0:
            return True
        new = self.blocks.allocate(missing)
        if new is None:
            return False
        seq.block_table.extend(new)
        return True

    def to_request(self, step: ScheduledStep, step_id: int, after_step_id: int = 0) -> pb.StepRequest:
        """The step as the shards see it: new sequences in full, running ones
        as the blocks appended since they last heard of them (the shards
        append the tokens they sampled themselves)."""
        request = pb.StepRequest(step_id=step_id, release_ids=step.release_ids, after_step_id=after_step_id)
        for seq, n in step.seqs:
            if not seq.on_shard:
                request.new_sequences.append(pb.NewSequence(
                    id=seq.id, token_ids=seq.token_ids, prompt_length=seq.prompt_length,
                    num_computed_tokens=seq.num_computed, num_scheduled_tokens=n,
                    block_table=seq.block_table, parameters=seq.params, adapter=seq.adapter))
            else:
                drafts = step.drafts.get(seq.id, 0)
                request.running.append(pb.RunningSequence(
                    id=seq.id, new_block_ids=seq.block_table[seq.shard_blocks:], num_scheduled_tokens=n - drafts,
                    num_draft_tokens=drafts))
            seq.on_shard, seq.shard_blocks = True, len(seq.block_table)
        return request

    def update(self, step: ScheduledStep, response: pb.StepResponse) -> list[Sequence]:
        """Applies the shards' generations and registers the blocks they
        filled; returns the sequences that finished. Sequences that ended
        while the step ran (cancelled, stop string) are left alone. Of
        several tokens sampled in one step (accepted drafts), those after
        one that ends the sequence are dropped."""
        by_id = {g.id: g for g in response.generations}
        seconds = response.timings.total_ns / 1e9
        if self.speculation is not None:
            self.speculation.observe(step.seqs, step.drafts, by_id, seconds)
        if self.pacer is not None and not step.drafts:
            decodes = sum(1 for seq, n in step.seqs if n == 1 and seq.num_generated)
            self.pacer.observe(decodes, sum(n for _, n in step.seqs) - decodes, seconds)
        finished = []
        for seq, n in step.seqs:
            if seq.status is not Status.RUNNING:
                continue
            gen = by_id[seq.id]
            start = seq.num_computed
            reason = None
            if gen.sampled:
                for i, token in enumerate((gen.token_id, *(t.token_id for t in gen.next_tokens))):
                    seq.token_ids.append(token)
                    last = i == len(gen.next_tokens)
                    reason = self._stop_reason(seq, token, gen.grammar_complete and last)
                    if reason is not None:
                        break
            # The known tokens scheduled, and the drafts accepted.
            seq.num_computed += n - step.drafts.get(seq.id, 0) + len(gen.next_tokens)
            if self.blocks.prefix_caching:
                first = start // self.blocks.block_size
                for block, h in zip(seq.block_table[first:],
                                    self._filled_hashes(seq, start, seq.num_computed - start)):
                    self.blocks.register(block, h)
            if seq.id in self._prefilling:
                self._prefilling[seq.id] += 1
                if gen.sampled:
                    self._stats.prefill_chunks.append(self._prefilling.pop(seq.id))
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    @staticmethod
    def _stop_reason(seq: Sequence, token: int, grammar_complete: bool) -> FinishReason | None:
        """TGI's order: the length limit wins over an EOS on the last token,
        except that a grammar completed by the last token ended the text:
        that is an end, as the EOS the grammar allows next would be."""
        if seq.num_generated >= seq.stopping.max_new_tokens:
            return FinishReason.EOS_TOKEN if grammar_complete else FinishReason.LENGTH
        if not seq.stopping.ignore_eos and token in seq.stopping.stop_token_ids:
            return FinishReason.EOS_TOKEN
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Ends seq (finished or cancelled): frees its blocks, and the shards
        drop it at the start of the next step."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        if seq.on_shard:
            self._to_release.append(seq.id)
        self.blocks.free(seq.block_table)
        self._prefilling.pop(seq.id, None)
        seq.block_table = []
        seq.status, seq.finish_reason = Status.FINISHED, reason
