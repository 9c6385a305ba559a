"""Paged KV block pool: the only owner of block tables.

Blocks are allocated as tokens are computed (never worst case up front) and
freed the moment a sequence finishes, aborts or is preempted.
"""

from __future__ import annotations

import collections


class BlockManager:
    """Device KV blocks of one executor incarnation.

    Invariant: every block id in [0, num_blocks) is either in the free list or
    in exactly one block table.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def num_new_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks ``seq_id`` lacks to hold ``num_tokens`` positions (hot: once per
        sequence per step, so no helper calls)."""
        table = self._tables.get(seq_id)
        need = -(-num_tokens // self.block_size) - (len(table) if table else 0)
        return need if need > 0 else 0

    def can_grow(self, seq_id: int, num_tokens: int, reserve: int = 0) -> bool:
        """True if ``seq_id`` can hold ``num_tokens`` positions, leaving ``reserve`` free."""
        return self.num_new_blocks(seq_id, num_tokens) + reserve <= len(self._free)

    def grow(self, seq_id: int, num_tokens: int) -> list[int]:
        """Extends ``seq_id``'s table to hold ``num_tokens`` positions; returns the new ids."""
        need = self.num_new_blocks(seq_id, num_tokens)
        if need == 0:
            return []
        assert need <= len(self._free), "grow() without can_grow()"
        new = [self._free.popleft() for _ in range(need)]
        self._tables.setdefault(seq_id, []).extend(new)
        return new

    def free(self, seq_id: int) -> None:
        """Returns all of ``seq_id``'s blocks to the pool. Idempotent."""
        self._free.extend(self._tables.pop(seq_id, ()))

    def assert_invariants(self) -> None:
        owned = [b for table in self._tables.values() for b in table]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert not set(owned) & set(self._free), "a block is both free and owned"
        assert len(owned) + len(self._free) == self.num_blocks, "blocks leaked"
