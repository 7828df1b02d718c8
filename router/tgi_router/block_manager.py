"""KV-cache block allocation for the router. Pure Python: block ids are
plain ints 0..num_blocks-1, matching the shards' caches."""


class BlockManager:
    """A free list of fixed-size blocks. Prefix caching (shared, reference
    counted blocks) builds on it later; today every block has one owner."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int) -> list[int] | None:
        """`count` blocks, or None (and nothing taken) when too few are free."""
        if count > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(count)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated")
            self._used.remove(b)
            self._free.append(b)
