"""KV-cache block allocation for the router, with prefix caching. Pure
Python: block ids are plain ints 0..num_blocks-1, matching the shards' caches.

Every block is in exactly one of three states:

* free: unreferenced and holding nothing reusable (never computed, or its
  contents were never registered);
* cached: unreferenced, but its full contents are registered under a prefix
  hash, so a later sequence with the same prefix can take it back as is;
  evicted least recently used when free blocks run out;
* used: referenced by the block tables of one or more live sequences (shared
  when several sequences hit the same cached prefix).

So num_free + num_cached + num_used == num_blocks at all times, and only
unreferenced blocks are ever evicted.
"""

from collections import OrderedDict
from typing import Literal

ROOT_HASH = 0  # the parent hash of a sequence's first block


def hash_block(parent: int, tokens: list[int]) -> int:
    """The prefix hash of a full block: its tokens chained with the hash of
    every token before it, so that equal blocks after different prefixes
    differ. Python's tuple hash (64 bits, not salted for ints): with ~1e5
    cached blocks a collision has probability ~1e-9."""
    return hash((parent, *tokens))


def chain_hashes(token_ids: list[int], block_size: int, known: list[int], count: int,
                 root: int = ROOT_HASH) -> None:
    """Extends `known` (prefix hashes of token_ids' first full blocks) in
    place to the first `count` full blocks; count <= len(token_ids) // block_size.
    root: the first block's parent (a LoRA adapter's own, so that the blocks
    of two adapters, whose keys and values differ, never match)."""
    for i in range(len(known), count):
        parent = known[-1] if known else root
        known.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size]))


class BlockManager:
    """Reference-counted blocks with an optional prefix cache.

    `allocate` hands out free blocks first, then evicts cached ones, least
    recently used first. `free` drops one reference per block; a block whose
    count reaches 0 becomes cached when its contents are registered, free
    otherwise. `lookup` + `share` reuse cached prefixes; `register` publishes
    a block once its K/V is fully computed (and never written again).
    prefix_caching=False: lookup finds nothing and register does nothing, so
    every unreferenced block is free."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced registered blocks, LRU first
        self._refs: list[int] = [0] * num_blocks
        self._by_hash: dict[int, int] = {}    # prefix hash -> block holding it
        self._hash_of: dict[int, int] = {}    # block -> its registered prefix hash
        self.num_used = 0

    @property
    def num_free(self) -> int:
        """Unreferenced blocks that hold nothing reusable."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks that hold a reusable prefix (evictable)."""
        return len(self._cached)

    @property
    def num_available(self) -> int:
        """Blocks `allocate` can hand out: free ones, then evicted cached ones."""
        return len(self._free) + len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int) -> list[int] | None:
        """`count` blocks, each with one reference, or None (and nothing
        taken) when fewer are available."""
        if count > self.num_available:
            return None
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._cached.popitem(last=False)
                del self._by_hash[self._hash_of.pop(block)]
            self._refs[block] = 1
            blocks.append(block)
        self.num_used += count
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drops one reference from each block. Walks the table backwards so
        that a sequence's tail blocks (the least shared) are evicted first."""
        if any(self._refs[b] == 0 for b in blocks):
            raise ValueError(f"freeing an unreferenced block among {blocks}")
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self.num_used -= 1
                if block in self._hash_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def lookup(self, hashes: list[int]) -> list[int]:
        """Blocks holding the longest run of `hashes` (prefix hashes of a
        sequence's first full blocks); takes no reference."""
        blocks = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Adds one reference to each block (from `lookup`)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._cached[block]
                self.num_used += 1
            self._refs[block] += 1

    def register(self, block: int, block_hash: int) -> None:
        """Publishes a referenced block whose K/V is fully computed under
        `block_hash`. A hash already held by another block (the same prefix
        computed twice at once) keeps its first block; this one stays private."""
        if not self.prefix_caching or block in self._hash_of or block_hash in self._by_hash:
            return
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def state(self, block: int) -> Literal["free", "cached", "used"]:
        """Which of the three states (the module's docstring) `block` is in."""
        if self._refs[block]:
            return "used"
        return "cached" if block in self._cached else "free"

    def registered_hash(self, block: int) -> int | None:
        """The prefix hash `block` is registered under, None while it holds
        nothing reusable; a registered block is never written again."""
        return self._hash_of.get(block)
