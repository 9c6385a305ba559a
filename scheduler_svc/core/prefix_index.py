"""The prefix cache's index: full device blocks by chain hash, with their tokens.

A full block is keyed by ``hash((parent_hash, block_tokens))``; a sequence's hashes
are cached in its ``block_hashes`` list and computed once in its lifetime, beside the
token tuples they were computed from (``block_chunks``), which the index keeps. The index
maps a hash to the block holding those tokens, and keeps each block's hash and tokens
(the tokens are compared on a hit: a hash collision is not a hit). Which blocks are
free, cached-free or owned is the block manager's (core/block_manager.py); it asks the
index to ``evict`` a cached-free block it hands out again, and ``forget`` everything
when the executor's cache is void. Every change is recorded in ``events`` when given
(core/kv_events.py).
"""

from __future__ import annotations

from scheduler_svc.core.kv_events import KVEventLog


class PrefixIndex:
    """``hashes[block]`` (None: unindexed) and ``tokens[block]`` for each device block,
    ``by_hash`` the reverse map; ``num_queries``/``num_hits`` count prompt blocks
    looked up and found."""

    __slots__ = ("num_blocks", "block_size", "hashes", "tokens", "by_hash", "events",
                 "num_queries", "num_hits")

    def __init__(self, num_blocks: int, block_size: int, events: KVEventLog | None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hashes: list[int | None] = [None] * num_blocks
        self.tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # collision check
        self.by_hash: dict[int, int] = {}
        self.events = events
        self.num_queries = 0
        self.num_hits = 0
        if events is not None:
            events.cleared()

    def lookup(self, token_ids: list[int], hashes: list[int], chunks: list[tuple] | None = None,
               count: bool = True) -> tuple[list[int], int]:
        """Indexed blocks matching the longest full-block prefix of ``token_ids``, and the
        chain hash of the last (see BlockManager.num_cached_prefix). ``hashes`` and
        ``chunks`` (the sequence's caches, see ``extend_hashes``) grow as far as it goes."""
        bs = self.block_size
        by_hash, stored = self.by_hash, self.tokens
        if chunks is None:
            chunks = []
        if len(chunks) < len(hashes):  # hashes given without their blocks' tokens
            self._fill_chunks(token_ids, hashes, chunks)
        hits: list[int] = []
        parent = 0
        queries = 0
        for i in range((len(token_ids) - 1) // bs):
            if i < len(hashes):
                h, chunk = hashes[i], chunks[i]
            else:
                chunk = tuple(token_ids[i * bs:(i + 1) * bs])
                h = hash((parent, chunk))
                hashes.append(h)
                chunks.append(chunk)
            queries += 1
            block = by_hash.get(h)
            if block is None or stored[block] != chunk:  # unseen, or a hash collision
                break
            hits.append(block)
            parent = h
        if count:
            self.num_queries += queries
            self.num_hits += len(hits)
        return hits, parent

    def _fill_chunks(self, token_ids: list[int], hashes: list[int],
                     chunks: list[tuple]) -> None:
        bs = self.block_size
        chunks.extend(tuple(token_ids[i * bs:(i + 1) * bs])
                      for i in range(len(chunks), len(hashes)))

    def extend_hashes(self, token_ids: list[int], hashes: list[int], num_blocks: int,
                      chunks: list[tuple] | None = None) -> None:
        """Extends ``hashes`` (a sequence's hash cache) to its first ``num_blocks`` full
        blocks, and ``chunks`` (its blocks' tokens, in step with ``hashes``) with them.
        The tuples built to hash are kept so that indexing a block stores a reference:
        a step never copies a prompt's tokens (read then, long after they arrived, their
        ints are out of the CPU's caches)."""
        if chunks is None:
            chunks = []
        if len(chunks) < len(hashes):
            self._fill_chunks(token_ids, hashes, chunks)
        bs = self.block_size
        parent = hashes[-1] if hashes else 0
        append, keep = hashes.append, chunks.append
        for start in range(len(hashes) * bs, num_blocks * bs, bs):
            chunk = tuple(token_ids[start:start + bs])
            parent = hash((parent, chunk))
            append(parent)
            keep(chunk)

    def register(self, table: list[int], token_ids: list[int], hashes: list[int],
                 start: int, full: int, released: int,
                 chunks: list[tuple] | None = None) -> None:
        """Indexes the blocks ``start..full`` of ``table`` (a sequence's, holding
        ``token_ids``; its first ``released`` entries are not its blocks any more), each
        unless its hash or the block is indexed already; ``hashes`` and ``chunks`` are
        extended."""
        if chunks is None:
            chunks = []
        if len(hashes) < full or len(chunks) < full:
            self.extend_hashes(token_ids, hashes, full, chunks)
        by_hash, block_hash, stored = self.by_hash, self.hashes, self.tokens
        indexed: list[int] | None = None if self.events is None else []
        for i in range(max(start, released), full):
            h = hashes[i]
            block = table[i]
            if h not in by_hash and block_hash[block] is None:
                by_hash[h] = block
                block_hash[block] = h
                stored[block] = chunks[i]
                if indexed is not None:
                    indexed.append(i)
        if indexed:
            self.events.stored_runs(indexed, hashes, token_ids, self.block_size)

    def evict(self, blocks: list[int]) -> None:
        """``blocks`` (cached-free) are handed out again: their entries go. Their stored
        tokens stay until they are indexed again: only a block found through ``by_hash``
        has them compared."""
        by_hash, hashes = self.by_hash, self.hashes
        evicted = []
        for block in blocks:
            evicted.append(hashes[block])
            del by_hash[hashes[block]]
            hashes[block] = None
        if self.events is not None:
            self.events.removed(evicted)

    def forget(self) -> None:
        """Empties the index: no block is found by hash again."""
        self.by_hash.clear()
        self.hashes = [None] * self.num_blocks
        self.tokens = [None] * self.num_blocks
        if self.events is not None:
            self.events.cleared()

    def indexed_blocks(self) -> dict[int, tuple[int, ...]]:
        """Chain hash → the block's token ids."""
        return {h: self.tokens[block] for h, block in self.by_hash.items()}

    def assert_invariants(self, evictable) -> None:
        for h, block in self.by_hash.items():
            assert self.hashes[block] == h, "hash index out of date"
        assert all(self.hashes[b] is not None for b in evictable), "unhashed block cached"
