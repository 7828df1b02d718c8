"""A fake shard that models the KV cache by content: each slot holds the
(position, token) whose K/V was written there. It applies the router's step
messages as a real shard does (new sequences in full, running ones as
deltas) and checks, for every scheduled sequence, that the slots its block
table maps to the already-computed positions hold exactly its tokens (what
attention would read), and that it never writes into a block another live
sequence references or whose contents are registered. It samples `next_token(tokens)`, a function of the
whole sequence, so outputs do not depend on batching or caching.

With a `drafter`, a running sequence allowed num_draft_tokens k drafts
drafter(tokens, k) after its last token, computes them (their K/V written
like any token's) and keeps them while each equals next_token of what
precedes it, as a real shard checks drafts."""

from collections.abc import Callable
from dataclasses import dataclass

from tgi_proto import pb
from tgi_router.scheduling.block_manager import BlockManager


def next_token(tokens: list[int]) -> int:
    return 3 + hash(tuple(tokens)) % 50


@dataclass
class _Seq:
    tokens: list[int]
    table: list[int]
    computed: int
    sampled: list[int] | None = None  # appended when the sequence is next scheduled, as a shard does


class FakeKVShard:
    def __init__(self, blocks: BlockManager, drafter: Callable[[list[int], int], list[int]] | None = None):
        self.bm = blocks
        self.drafter = drafter
        self.drafted = self.accepted = 0
        self.slots: dict[int, tuple[int, int]] = {}  # slot -> (position, token)
        self.seqs: dict[int, _Seq] = {}
        self.tokens_computed = 0

    def step(self, request: pb.StepRequest) -> pb.StepResponse:
        for i in request.release_ids:
            self.seqs.pop(i, None)
        scheduled = []
        for r in request.running:
            seq = self.seqs[r.id]
            if seq.sampled is not None:
                seq.tokens.extend(seq.sampled)
                seq.sampled = None
            seq.table.extend(r.new_block_ids)
            assert not r.num_draft_tokens or r.num_scheduled_tokens == 1
            drafts = self.drafter(list(seq.tokens), r.num_draft_tokens) if r.num_draft_tokens else []
            assert len(drafts) <= r.num_draft_tokens
            scheduled.append((r.id, seq, r.num_scheduled_tokens, drafts))
        for n in request.new_sequences:
            assert n.id not in self.seqs
            seq = _Seq(list(n.token_ids), list(n.block_table), n.num_computed_tokens)
            self.seqs[n.id] = seq
            scheduled.append((n.id, seq, n.num_scheduled_tokens, []))
        return pb.StepResponse(generations=[self._run(*args) for args in scheduled])

    def _run(self, seq_id: int, seq: _Seq, n: int, drafts: list[int]) -> pb.Generation:
        bs = self.bm.block_size
        assert n >= 1 and seq.computed + n <= len(seq.tokens), (seq_id, seq.computed, n, len(seq.tokens))
        known = len(seq.tokens)
        seq.tokens.extend(drafts)
        n += len(drafts)
        assert len(seq.table) * bs >= seq.computed + n
        for p in range(seq.computed):
            slot = seq.table[p // bs] * bs + p % bs
            assert self.slots.get(slot) == (p, seq.tokens[p]), f"seq {seq_id} reads a wrong K/V at {p}"
        for p in range(seq.computed, seq.computed + n):
            block = seq.table[p // bs]
            # 0: its sequence was cancelled while this step was in flight
            assert self.bm.ref_count(block) <= 1 and self.bm.registered_hash(block) is None, \
                f"seq {seq_id} writes into block {block}, shared or registered"
            self.slots[block * bs + p % bs] = (p, seq.tokens[p])
        self.tokens_computed += n
        if seq.computed + n < len(seq.tokens):
            seq.computed += n
            return pb.Generation(id=seq_id, num_computed_tokens=seq.computed)
        sampled = [next_token(seq.tokens[:known + i]) for i in range(len(drafts) + 1)]
        kept = 1
        while kept <= len(drafts) and sampled[kept - 1] == drafts[kept - 1]:
            kept += 1
        del seq.tokens[known:]
        seq.computed += n - len(drafts) + kept - 1
        self.drafted += len(drafts)
        self.accepted += kept - 1
        seq.sampled = sampled[:kept]
        return pb.Generation(id=seq_id, num_computed_tokens=seq.computed, sampled=True, token_id=sampled[0],
                             next_tokens=[pb.NextToken(token_id=t) for t in sampled[1:kept]],
                             num_drafted=len(drafts))
