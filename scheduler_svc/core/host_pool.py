"""The host (swap) pool: host blocks a swapped-out sequence's KV is copied into.

The block manager (core/block_manager.py) moves a sequence between the device and this
pool (``swap_out``/``swap_in``); the pool keeps the free host blocks, each swapped
sequence's host table, and how far its blocks had been considered for the prefix index
when it left, so registration resumes where it was.
"""

from __future__ import annotations


class HostPool:
    """Host blocks of one executor incarnation: free, or in exactly one host table."""

    __slots__ = ("num_blocks", "_free", "_tables", "_registered")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self._tables: dict[int, list[int]] = {}
        self._registered: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_swapped(self) -> int:
        """Sequences whose KV is here now."""
        return len(self._tables)

    def table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def take(self, n: int) -> list[int]:
        """``n`` free host blocks (needs ``num_free >= n``), for ``hold``."""
        free = self._free
        return [free.pop() for _ in range(n)]

    def hold(self, seq_id: int, blocks: list[int], num_registered: int) -> None:
        """``seq_id``'s KV is in ``blocks``; ``num_registered``: its first blocks that had
        been considered for the prefix index."""
        self._tables[seq_id] = blocks
        self._registered[seq_id] = num_registered

    def give_back(self, seq_id: int) -> tuple[list[int], int]:
        """``seq_id`` goes back to the device: its host blocks (free again) and its
        registration count."""
        blocks = self._tables.pop(seq_id)
        self._free.extend(blocks)
        return blocks, self._registered.pop(seq_id)

    def release(self, seq_id: int) -> None:
        """Frees ``seq_id``'s host blocks, if any. Idempotent."""
        blocks = self._tables.pop(seq_id, None)
        if blocks:
            self._free.extend(blocks)
        self._registered.pop(seq_id, None)

    def assert_invariants(self) -> None:
        owned = [b for t in self._tables.values() for b in t]
        assert len(owned) == len(set(owned)), "a host block is owned twice"
        assert len(owned) + len(self._free) == self.num_blocks, "host leak"
