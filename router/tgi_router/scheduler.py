"""Continuous batching under a token budget, with no prefill or decode
phase: each step gives running sequences their tokens first, then admits
waiting ones while the budget and free blocks allow. A prompt longer than
the budget left is computed in chunks over several steps. When blocks run
out, the most recently admitted sequence is preempted (its blocks freed, to
be recomputed later from its tokens): never a crash or a stall."""

from collections import deque
from dataclasses import dataclass

from tgi_proto import pb

from .block_manager import BlockManager
from .sequence import FinishReason, Sequence, Status


@dataclass(frozen=True)
class ScheduledStep:
    seqs: list[tuple[Sequence, int]]   # (sequence, tokens to compute), running first
    release_ids: list[int]             # sequences the shards should drop first


class Scheduler:
    """max_batch_tokens: tokens computed per step (--max-batch-prefill-tokens).
    waiting_served_ratio / max_waiting_tokens keep TGI's meaning: while
    sequences run, waiting ones join only when they number at least
    ratio x running, or when max_waiting_tokens steps passed since the last
    join."""

    def __init__(self, blocks: BlockManager, max_batch_tokens: int, max_batch_size: int = 0,
                 waiting_served_ratio: float = 0.0, max_waiting_tokens: int = 0):
        self.blocks = blocks
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

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def pending_release(self) -> bool:
        return bool(self._to_release)

    def schedule(self) -> ScheduledStep:
        budget = self.max_batch_tokens
        chosen: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0 or len(chosen) >= self.max_batch_size:
                continue  # preempted by an earlier one in this loop, or no room this step
            n = min(seq.remaining, budget)
            while not self._grow(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                chosen.append((seq, n))
                budget -= n
        if self._may_join(len(chosen)):
            budget = self._admit(chosen, budget)
        self._steps_since_join += 1
        return ScheduledStep(chosen, self.take_releases())

    def take_releases(self) -> list[int]:
        """Ids the shards must drop, handed out once."""
        release, self._to_release = self._to_release, []
        return release

    def _may_join(self, running: int) -> bool:
        self.join_reason = None
        if not self.waiting or not running:
            return bool(self.waiting)
        if self._steps_since_join >= self.max_waiting_tokens:
            self.join_reason = "wait_exceeded"
            return True
        self.join_reason = "backpressure"
        return len(self.waiting) >= int(running * self.waiting_served_ratio)

    def _admit(self, chosen: list[tuple[Sequence, int]], budget: int) -> int:
        joined = False
        while self.waiting and budget > 0 and len(chosen) < self.max_batch_size:
            seq = self.waiting[0]
            n = min(seq.remaining, budget)
            if not self._grow(seq, n):
                break  # first come, first served: do not let later ones overtake
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            chosen.append((seq, n))
            budget -= n
            joined = True
        if joined:
            self._steps_since_join = 0
        return budget

    def _preempt(self, seq: Sequence) -> None:
        """Frees seq's blocks and puts it first in line; it is recomputed from
        its tokens (prompt and generated so far) when blocks free up."""
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        if seq.shard_tokens:
            self._to_release.append(seq.id)
        seq.block_table = []
        seq.num_computed = 0
        seq.shard_tokens = seq.shard_blocks = 0
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

    def to_request(self, step: ScheduledStep, step_id: int) -> pb.StepRequest:
        """The step as the shards see it: new sequences in full, running ones
        as the tokens and blocks appended since they last heard of them."""
        request = pb.StepRequest(step_id=step_id, release_ids=step.release_ids)
        for seq, n in step.seqs:
            if seq.shard_tokens == 0:
                request.new_sequences.append(pb.NewSequence(
                    id=seq.id, token_ids=seq.token_ids, prompt_length=seq.prompt_length,
                    num_computed_tokens=seq.num_computed, num_scheduled_tokens=n,
                    block_table=seq.block_table, parameters=seq.params))
            else:
                request.running.append(pb.RunningSequence(
                    id=seq.id, append_token_ids=seq.token_ids[seq.shard_tokens:],
                    new_block_ids=seq.block_table[seq.shard_blocks:], num_scheduled_tokens=n))
            seq.shard_tokens, seq.shard_blocks = len(seq.token_ids), len(seq.block_table)
        return request

    def update(self, step: ScheduledStep, response: pb.StepResponse) -> list[Sequence]:
        """Applies the shards' generations; returns the sequences that finished."""
        by_id = {g.id: g for g in response.generations}
        finished = []
        for seq, n in step.seqs:
            seq.num_computed += n
            gen = by_id[seq.id]
            if not gen.sampled:
                continue
            seq.token_ids.append(gen.token_id)
            reason = self._stop_reason(seq, gen.token_id)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    @staticmethod
    def _stop_reason(seq: Sequence, token: int) -> FinishReason | None:
        """TGI's order: the length limit wins over an EOS on the last token."""
        if seq.num_generated >= seq.stopping.max_new_tokens:
            return FinishReason.LENGTH
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
        if seq.shard_tokens:
            self._to_release.append(seq.id)
        self.blocks.free(seq.block_table)
        seq.block_table = []
        seq.status, seq.finish_reason = Status.FINISHED, reason
