"""Drafting with a small model (--speculative-model): any model the shard
can serve whose tokenizer is the target's, run in the same shard.

Its K/V lives in a cache of its own with the target's block ids: block b of
a sequence holds the target's K/V in the target's cache and the draft's in
this one, so the router's block manager manages both (a block freed,
shared by prefix caching or preempted is so for both) and Warmup sizes the
pool from the two caches' bytes per block together.

A sequence's draft_computed counts the leading positions whose draft K/V is
valid. Proposing k drafts after known tokens t[0..L-1]: one forward over
t[draft_computed..L-1] (usually the last token alone; the whole prompt the
first time), the argmax of its last row is draft 1; then k - 1 one-token
forwards, each feeding the last draft. The draft K/V is then valid up to
position L + k - 2; once the target has checked the drafts and kept j of
them (ShardSequence.settle), up to L + min(j, k - 1) - 1: positions of
rejected drafts hold stale K/V that the next forward over them overwrites.
A prefix-cache hit trusts the draft K/V of the blocks it shares, computed
by the sequence that filled them (when it drafted: were it stale, the
drafts would only be rejected more often; the output is the target's
either way).

Drafts are the draft model's argmax (one token with certainty), which the
check in verify.py needs for sampled sequences to keep the target's
distribution exactly."""

import torch

from ..batch import build_batch
from ..kv_cache import KVCache, KVCacheSpec
from ..model_loader import LoadedModel
from ..sequences import ShardSequence


class DraftModel:
    """loaded: the draft, loaded for the target's device, dtype and tensor
    parallel group; vocab_size: the target's (drafts stay inside it)."""

    def __init__(self, loaded: LoadedModel, block_size: int, backend: str, vocab_size: int,
                 kv_dtype: torch.dtype | None = None):
        self.model = loaded.model
        self.device = loaded.device
        self.block_size = block_size
        self.backend = backend
        self.vocab_size = min(vocab_size, loaded.config.vocab_size)
        self.kv_spec = KVCacheSpec(loaded.config.num_layers, loaded.model.heads.num_kv_heads,
                                   loaded.config.head_dim, block_size, kv_dtype or loaded.dtype)
        self.cache = KVCache(self.kv_spec, 0, self.device)

    def allocate(self, num_blocks: int) -> None:
        """A cache of num_blocks blocks (the target's count), emptied."""
        self.cache = None  # free the old one first
        self.cache = KVCache(self.kv_spec, num_blocks, self.device)

    def propose(self, seqs: list[ShardSequence]) -> None:
        """Appends up to draft_limit drafts to each sequence (see the module doc)."""
        # First forward: each sequence's tokens from draft_computed to its last known one.
        views = [_View(s, s.draft_computed, len(s.token_ids) - s.draft_computed) for s in seqs]
        drafts = self._next(views)
        active = seqs
        for _ in range(max(s.draft_limit for s in seqs)):
            for seq, token in zip(active, drafts):
                seq.add_drafts([token])
                seq.draft_computed = len(seq.token_ids) - 1  # the draft K/V now reaches its last input
            active = [s for s in active if s.drafted < s.draft_limit]
            if not active:
                break
            drafts = self._next([_View(s, len(s.token_ids) - 1, 1) for s in active])

    def _next(self, views: list["_View"]) -> list[int]:
        """The draft model's argmax after each view's tokens, its K/V written."""
        batch = build_batch(views, self.block_size, self.device)
        ctx = batch.context(self.cache.layers, self.backend)
        logits = self.model.logits(self.model(batch.input_ids, ctx), batch.logits_rows)  # [S, vocab]
        best = logits[:, :self.vocab_size].argmax(dim=-1).tolist()
        # build_batch orders decodes (one token) before longer chunks: back to the views' order.
        order = {id(v): i for i, v in enumerate(batch.seqs)}
        return [best[order[id(v)]] for v in views]


class _View(ShardSequence):
    """A sequence as one draft forward sees it: computing `scheduled` tokens
    after `computed` ones, sampling after the last (build_batch's input)."""

    def __init__(self, seq: ShardSequence, computed: int, scheduled: int):
        super().__init__(id=seq.id, token_ids=seq.token_ids, prompt_length=seq.prompt_length,
                         num_computed=computed, block_table=seq.block_table, params=seq.params,
                         prefill_logprobs=False, scheduled=scheduled)
