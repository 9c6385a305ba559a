"""The prefix cache's index: full device blocks by chain hash, with their tokens.

A full block is keyed by ``hash((parent_hash, block_tokens))``; a sequence's hashes
(``block_hashes``) and the token tuples behind them (``block_chunks``) are computed once
in its lifetime. The index maps a hash to its block and keeps each block's tokens, which
are compared on a hit (a collision is not a hit). Free, cached-free or owned is the block
manager's business; it asks the index to ``evict`` a block it hands out again and to
``forget`` everything when the executor's cache is void. Changes go to ``events``.

Indexing is lazy where nobody listens to the events, so a step pays per block only for
what is reused: registering a sequence's blocks records one run (``_Run``), found by its
first block's hash (``hashes[block] is run``). Its blocks enter ``by_hash`` only when a
lookup reaches that first hash. A run whose first hash is not computed yet (an answer's
blocks) is found by the hash before it (``following``); where the run before is the same
sequence's and still lazy, it grows instead: one run per sequence, one key.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from scheduler_svc.core.kv_events import KVEventLog


class _Run:
    """A sequence's blocks ``lo..full`` (of ``table``, holding ``token_ids``, with the
    sequence's hash and chunk caches), registered but not yet in ``by_hash``; ``live``
    of them still hold its content (marked with it). ``key``: its first block's hash (in
    ``pending``) or, ``after`` set, the hash of the block before it (in ``following``)."""

    __slots__ = ("table", "token_ids", "hashes", "chunks", "lo", "full", "key", "after",
                 "live")

    def __init__(self, table: list[int], token_ids: list[int], hashes: list[int],
                 chunks: list[tuple], lo: int, full: int, after: bool) -> None:
        self.table, self.token_ids, self.hashes, self.chunks = table, token_ids, hashes, chunks
        self.lo, self.full, self.after = lo, full, after
        self.key = hashes[lo - 1] if after else hashes[lo]
        self.live = 0


def _mark(block_hash: list, blocks: list[int], run: _Run) -> int:
    """Marks those of ``blocks`` that hold nothing indexed with ``run``; how many."""
    live = 0
    for block in blocks:
        if block_hash[block] is None:
            block_hash[block] = run
            live += 1
    return live


class PrefixIndex:
    """``hashes[block]`` (None: unindexed; a ``_Run``: registered, indexed when looked
    up) and ``tokens[block]`` for each device block, ``by_hash`` the reverse map of the
    indexed ones, ``pending`` the runs by their first block's hash and ``following``
    those by the hash before their first block; ``num_queries``/``num_hits`` count
    prompt blocks looked up and found. ``dropped`` is told of blocks a run leaves
    unindexed after all (their hash was taken by another block meanwhile): the pool
    moves a cached-free one to its free list."""

    __slots__ = ("num_blocks", "block_size", "hashes", "tokens", "by_hash", "events",
                 "num_queries", "num_hits", "pending", "following", "dropped")

    def __init__(self, num_blocks: int, block_size: int, events: KVEventLog | None,
                 dropped: Callable[[list[int]], None] | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hashes: list[int | _Run | None] = [None] * num_blocks
        self.tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # collision check
        self.by_hash: dict[int, int] = {}
        self.pending: dict[int, _Run] = {}
        self.following: dict[int, _Run] = {}
        self.dropped = dropped
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
            if block is None and (h in self.pending or parent in self.following):
                self._index_runs_at(h, parent)  # registered lazily: index it now
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
        extended as far as that needs. Lazily (see the module docstring) unless events
        are recorded or the run's first hash is indexed or pending already."""
        lo = max(start, released)
        if lo >= full:
            return
        if chunks is None:
            chunks = []
        if self.events is None:
            after = lo > 0 and len(hashes) == lo  # an answer's: found by the hash before it
            if not after and len(hashes) <= lo:
                self.extend_hashes(token_ids, hashes, lo + 1, chunks)
            block_hash = self.hashes
            if after:  # the run before it, still lazy, of this sequence: it grows instead
                run = block_hash[table[lo - 1]]
                if (run.__class__ is _Run and run.full == lo and run.table is table
                        and run.token_ids is token_ids):
                    run.live += _mark(block_hash, table[lo:full], run)
                    run.full = full
                    return
            key = hashes[lo - 1] if after else hashes[lo]
            if (key not in self.following if after  # else eagerly
                    else key not in self.by_hash and key not in self.pending):
                run = _Run(table, token_ids, hashes, chunks, lo, full, after)
                live = _mark(block_hash, table[lo:full], run)
                if live:
                    run.live = live
                    (self.following if after else self.pending)[key] = run
                return
        self._index(table, token_ids, hashes, lo, full, chunks, None)

    def _index(self, table: list[int], token_ids: list[int], hashes: list[int], lo: int,
               full: int, chunks: list[tuple], run: _Run | None) -> None:
        """Enters the blocks ``lo..full`` into ``by_hash`` (those still marked with
        ``run``, when it is given; else the unindexed ones)."""
        if len(hashes) < full or len(chunks) < full:
            self.extend_hashes(token_ids, hashes, full, chunks)
        by_hash, block_hash, stored = self.by_hash, self.hashes, self.tokens
        pending, following = self.pending, self.following
        indexed: list[int] | None = None if self.events is None else []
        dropped: list[int] = []
        parent = hashes[lo - 1] if lo else 0
        for i in range(lo, full):
            h = hashes[i]
            block = table[i]
            if (pending and h in pending) or (following and parent in following):
                self._index_runs_at(h, parent)  # registered first: it is indexed first
            parent = h
            if block_hash[block] is run:
                if h in by_hash:  # another block holds that content: this one stays out
                    if run is not None:
                        block_hash[block] = None
                        dropped.append(block)
                    continue
                by_hash[h] = block
                block_hash[block] = h
                stored[block] = chunks[i]
                if indexed is not None:
                    indexed.append(i)
        if indexed:
            self.events.stored_runs(indexed, hashes, token_ids, self.block_size)
        if dropped and self.dropped is not None:
            self.dropped(dropped)

    def _index_run(self, run: _Run) -> None:
        self._index(run.table, run.token_ids, run.hashes, run.lo, run.full, run.chunks, run)

    def _index_runs_at(self, h: int, parent: int) -> None:
        """Indexes the pending run whose first hash is ``h`` and the one after ``parent``."""
        run = self.pending.pop(h, None)
        if run is not None:
            self._index_run(run)
        run = self.following.pop(parent, None)
        if run is not None:
            self._index_run(run)

    def index_pending(self) -> None:
        """Indexes every pending run (what eager indexing would hold now)."""
        for runs in (self.pending, self.following):
            while runs:
                self._index_run(runs.pop(next(iter(runs))))

    def evict(self, blocks: list[int]) -> None:
        """``blocks`` (cached-free) are handed out again: their entries go. Their stored
        tokens stay until they are indexed again: only a block found through ``by_hash``
        has them compared."""
        by_hash, hashes = self.by_hash, self.hashes
        evicted = []
        for block in blocks:
            h = hashes[block]
            if h.__class__ is _Run:  # a pending run's block, never in by_hash
                h.live -= 1
                if not h.live:  # nothing of it is left to index
                    del (self.following if h.after else self.pending)[h.key]
            else:
                evicted.append(h)
                del by_hash[h]
            hashes[block] = None
        if self.events is not None:
            self.events.removed(evicted)

    def forget(self) -> None:
        """Empties the index: no block is found by hash again."""
        self.by_hash.clear()
        self.pending.clear()
        self.following.clear()
        self.hashes = [None] * self.num_blocks
        self.tokens = [None] * self.num_blocks
        if self.events is not None:
            self.events.cleared()

    def indexed_blocks(self) -> dict[int, tuple[int, ...]]:
        """Chain hash → the block's token ids (pending runs indexed first)."""
        self.index_pending()
        return {h: self.tokens[block] for h, block in self.by_hash.items()}

    def assert_invariants(self, evictable) -> None:
        for h, block in self.by_hash.items():
            assert self.hashes[block] == h, "hash index out of date"
        assert all(self.hashes[b] is not None for b in evictable), "unhashed block cached"
        marked = collections.Counter(h for h in self.hashes if h.__class__ is _Run)
        runs = [*self.pending.values(), *self.following.values()]
        assert marked == {run: run.live for run in runs}, "runs' counts"
        for h, run in self.pending.items():
            assert h == run.key == run.hashes[run.lo] and not run.after, "a run's key"
            assert h not in self.by_hash, "a pending run's hash is indexed"
        for h, run in self.following.items():
            assert run.after and h == run.key == run.hashes[run.lo - 1], "a run's key"
