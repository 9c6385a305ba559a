"""Paged KV block pool with prefix caching: the only owner of block tables.

Blocks are allocated as tokens are computed (never worst case up front) and released the
moment a sequence finishes, aborts or is preempted.

Prefix caching: a full block is keyed by a chain hash ``hash((parent_hash, block_tokens))``
in the index (core/prefix_index.py); prompt blocks are registered as prefill computes them,
decoded ones when the sequence leaves the running set. A new sequence whose prompt starts
with the same full blocks shares them (ref-counted, read-only) and computes only the rest.
A released registered block stays cached, evicted least-recently-used only for room.

Every device block is in exactly one of three states:

    ============  ==========  =========================================
    state         ref_count   where
    ============  ==========  =========================================
    free          0           the pool's ``free`` (no valid content)
    cached-free   0           the pool's ``evictable`` (LRU order) + the index
    owned         >= 1        in block tables (maybe also indexed)
    ============  ==========  =========================================

Under a sliding window (``KVWindow``) growing a table releases the blocks no layer reads
again; their entries stay in the table (``num_released``). The blocks themselves are
core/block_pool.py's, the host (swap) blocks ``HostPool``'s; ``swap_out``/``swap_in`` move
a sequence between the two.
"""

from __future__ import annotations

import collections
import enum

from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.kv_events import KVEventLog


class NoBlock(enum.Enum):
    """Why ``try_append_block`` appended nothing though a block is needed."""

    # It takes more than one block, or none is free: use ``can_grow``/``grow``
    # (which may have to preempt first).
    NEEDS_GROW = 0


NEEDS_GROW = NoBlock.NEEDS_GROW


class BlockManager:
    """Device KV blocks of one executor incarnation, plus a host (swap) pool.

    Predicate/action pairs: ``can_grow``/``grow``, ``num_cached_prefix``/
    ``share_prefix``, ``can_swap_out``/``swap_out``, ``can_swap_in``/``swap_in``;
    ``free`` releases. ``assert_invariants`` checks the state table above. With
    ``events``, every change to the hash index is recorded there (core/kv_events.py),
    starting with ``cleared``: a new pool holds nothing.
    """

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True,
                 events: KVEventLog | None = None, window: int = 0,
                 max_step_tokens: int = 0) -> None:
        assert num_blocks >= 0 and block_size > 0 and num_host_blocks >= 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._pool = BlockPool(num_blocks, block_size, events)
        self._tables: dict[int, list[int]] = {}
        # seq → how many of its first blocks were considered for the index (registered,
        # or shared from it); their hashes are the first entries of its ``hashes`` list.
        self._num_registered: dict[int, int] = {}
        self._host = HostPool(num_host_blocks)
        self.events = events
        # window: every layer's widest sliding window in tokens (0: some layer sees the
        # whole context, nothing is released); max_step_tokens: see KVWindow.
        self.window = window
        self._window = KVWindow(window, num_blocks, block_size, max_step_tokens) \
            if window else None
        self._released: dict[int, int] = {}  # seq → leading table entries it no longer owns

    # -- accounting ------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + cached-free)."""
        pool = self._pool
        return len(pool.free) + len(pool.evictable)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._pool.evictable)

    @property
    def num_free_host_blocks(self) -> int:
        return self._host.num_free

    @property
    def num_cache_queries(self) -> int:
        """Prompt blocks looked up in the prefix cache."""
        return self._pool.index.num_queries

    @property
    def num_cache_hits(self) -> int:
        """Of those, found cached."""
        return self._pool.index.num_hits

    @property
    def usage(self) -> float:
        """Fraction of device blocks owned by sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def step_cap(self) -> int:
        """The most tokens the scheduler may compute for one sequence in a step (0: no
        cap; KVWindow.step_cap)."""
        return self._window.step_cap if self._window else 0

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` positions holds at most at once."""
        need = -(-num_tokens // self.block_size)
        window = self._window
        return need if window is None or need < window.max_live else window.max_live

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def num_released(self, seq_id: int) -> int:
        """Leading entries of ``seq_id``'s table released under the window (not its
        blocks any more, never read)."""
        return self._released.get(seq_id, 0)

    def host_table(self, seq_id: int) -> list[int]:
        return self._host.table(seq_id)

    def num_new_blocks(self, seq_id: int, num_tokens: int, computing: int = 0) -> int:
        """Blocks the pool gives up for ``seq_id`` to hold ``num_tokens`` positions (hot
        path); ``computing`` as for ``grow``: under a window, less what it releases."""
        table = self._tables.get(seq_id)
        need = -(-num_tokens // self.block_size) - (len(table) if table else 0)
        if need > 0 and computing and self.window and table:
            need -= self._num_releasable(seq_id, num_tokens - computing)
        return need if need > 0 else 0

    def _num_releasable(self, seq_id: int, first_query: int) -> int:
        """Blocks ``_release_behind(seq_id, first_query)`` would return to the pool."""
        upto = self._window.behind(first_query)
        done = self._released.get(seq_id, 0)
        if upto <= done:
            return 0
        ref = self._pool.ref
        return sum(ref[b] == 1 for b in self._tables[seq_id][done:upto])

    # -- growing ----------------------------------------------------------------------

    def can_grow(self, seq_id: int, num_tokens: int, reserve: int = 0,
                 computing: int = 0) -> bool:
        """True if ``seq_id`` can hold ``num_tokens`` positions, leaving ``reserve`` free."""
        return (self.num_new_blocks(seq_id, num_tokens, computing) + reserve
                <= self.num_free_blocks)

    def grow(self, seq_id: int, num_tokens: int, computing: int = 0) -> list[int]:
        """Extends ``seq_id``'s table to hold ``num_tokens`` positions; returns new ids.
        ``computing``: the tokens this step computes, the last of those positions (0:
        not known; under a window the fewest blocks are then released). Under a window
        what the step no longer reads goes back first, so the pool may hand it out again."""
        table = self._tables.get(seq_id)
        need = -(-num_tokens // self.block_size) - (len(table) if table else 0)
        if need <= 0:
            return []
        if self.window and table is not None:
            self._release_behind(seq_id, num_tokens - (computing or num_tokens))
        assert need <= self.num_free_blocks, "grow() without can_grow()"
        new = self._pool.take(need)
        if table is None:
            self._tables[seq_id] = new[:]
        else:
            table.extend(new)
        return new

    def append_each(self, seq_ids: list[int]) -> list[int]:
        """Appends one block to each of ``seq_ids``' tables (decodes crossing into a new
        block, holding none for it yet), in one take from the pool; returns them in
        order. Needs as many free blocks and no window (``try_append_block`` else)."""
        new = self._pool.take(len(seq_ids))
        tables = self._tables
        for seq_id, block in zip(seq_ids, new, strict=True):
            tables[seq_id].append(block)
        return new

    def try_append_block(self, seq_id: int, num_tokens: int) -> int | NoBlock | None:
        """The hot case of ``grow`` for a decode: the block id appended so ``seq_id``
        holds ``num_tokens`` positions, None if it holds them already, NEEDS_GROW if
        that takes more than one block or none is free (then ``can_grow``/``grow``)."""
        table = self._tables[seq_id]
        need = -(-num_tokens // self.block_size) - len(table)
        if need <= 0:
            return None
        if need > 1:
            return NEEDS_GROW
        if self.window:
            self._release_behind(seq_id, num_tokens - 1)
        pool = self._pool
        if not (pool.free or pool.evictable):
            return NEEDS_GROW
        block = pool.take_one()
        table.append(block)
        return block

    def _release_behind(self, seq_id: int, first_query: int) -> None:
        """Releases ``seq_id``'s blocks wholly before the window of a query at
        ``first_query``, the earliest position this or any later step computes (one
        position more is kept than the window reads)."""
        upto = self._window.behind(first_query)
        done = self._released.get(seq_id, 0)
        if upto <= done:
            return
        self._pool.release(self._tables[seq_id][done:upto][::-1])
        self._released[seq_id] = upto

    # -- prefix cache -----------------------------------------------------------------

    def num_cached_prefix(self, token_ids: list[int], hashes: list[int],
                          chunks: list[tuple] | None = None,
                          count: bool = True) -> tuple[list[int], int]:
        """Cached blocks matching the longest full-block prefix of ``token_ids``, and the
        chain hash of the last. ``hashes`` is the sequence's hash cache (chain hashes of
        its first full blocks), ``chunks`` their blocks' tokens; both are extended as far
        as the lookup goes. At least one token is always left to compute, so the step
        that completes the prompt samples. ``count``: the look-up counts in the hit
        statistics (``num_cache_queries``/``_hits``)."""
        if not self.enable_prefix_caching:
            return [], 0
        return self._pool.index.lookup(token_ids, hashes, chunks, count)

    @property
    def num_swapped(self) -> int:
        """Sequences whose KV is in the host pool now."""
        return self._host.num_swapped

    def num_exclusive(self, seq_id: int) -> int:
        """Device blocks only ``seq_id`` holds (what freeing it gives back)."""
        ref = self._pool.ref
        table = self._tables.get(seq_id, ())
        return sum(1 for b in table[self._released.get(seq_id, 0):] if ref[b] == 1)

    def num_unreferenced(self, blocks: list[int]) -> int:
        """How many of ``blocks`` are cached-free (sharing them takes them from the pool)."""
        return self._pool.num_unreferenced(blocks)

    def share_prefix(self, seq_id: int, blocks: list[int]) -> None:
        """Starts ``seq_id``'s table with cached ``blocks`` (from num_cached_prefix)."""
        assert seq_id not in self._tables, "share_prefix() on a sequence with blocks"
        self._pool.share(blocks)
        self._tables[seq_id] = list(blocks)
        self._num_registered[seq_id] = len(blocks)

    def extend_hashes(self, token_ids: list[int], hashes: list[int], num_blocks: int,
                      chunks: list[tuple] | None = None) -> None:
        """Extends ``hashes`` (a sequence's hash cache) to its first ``num_blocks`` full
        blocks, and ``chunks`` with their tokens. The scheduler calls it as a request
        arrives, so admission and prefill only look them up."""
        if self.enable_prefix_caching:
            self._pool.index.extend_hashes(token_ids, hashes, num_blocks, chunks)

    def register_full_blocks(self, seq_id: int, token_ids: list[int], hashes: list[int],
                             num_computed: int, chunks: list[tuple] | None = None) -> None:
        """Hashes and registers ``seq_id``'s blocks that ``num_computed`` tokens fill.

        ``hashes`` is the sequence's hash cache, ``chunks`` their tokens: blocks hashed
        before (on arrival, by a prefix lookup, or before a preemption) are not hashed
        again."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        # Scheduled ahead, a block may be computed before its last token is known.
        full = min(num_computed, len(token_ids)) // bs
        start = self._num_registered.get(seq_id, 0)
        if start >= full:
            return
        self._num_registered[seq_id] = full
        self._pool.index.register(self._tables[seq_id], token_ids, hashes, start, full,
                                  self._released.get(seq_id, 0), chunks)

    def forget_cached(self) -> None:
        """Empties the prefix index (the executor may not hold what it claims):
        cached-free blocks become free and no block is found by hash again."""
        self._pool.forget_cached()

    def indexed_blocks(self) -> dict[int, tuple[int, ...]]:
        """The hash index now: chain hash → the block's token ids (what a subscriber
        to the KV events must have rebuilt)."""
        return self._pool.index.indexed_blocks()

    # -- release ----------------------------------------------------------------------

    def free(self, seq_id: int) -> None:
        """Releases ``seq_id``'s device and host blocks. Idempotent.

        Released hashed blocks become cached-free; the tail of the table is
        released first so LRU eviction takes a prefix's last blocks before its
        first ones (the first are the likeliest to be shared again)."""
        self._num_registered.pop(seq_id, None)
        table = self._tables.pop(seq_id, None)
        released = self._released.pop(seq_id, 0)
        if table:
            self._pool.release(reversed(table[released:]))
        self._host.release(seq_id)

    # -- swap ---------------------------------------------------------------------------

    def can_swap_out(self, seq_id: int) -> bool:
        return (len(self.block_table(seq_id)) - self._released.get(seq_id, 0)
                <= self._host.num_free)

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Moves ``seq_id``'s KV to host blocks; returns (device, host) copy pairs.

        The device blocks are released (shared or hashed ones stay valid for
        their other users or the cache: the copy happens before anyone writes)."""
        released = self._released.get(seq_id, 0)
        table = self._tables[seq_id][released:]
        host = self._host.take(len(table))
        pairs = list(zip(table, host, strict=True))
        num_registered = self._num_registered.get(seq_id, 0)
        self.free(seq_id)
        self._host.hold(seq_id, host, num_registered)
        if released:
            self._released[seq_id] = released  # the entries stay released on the host
        return pairs

    def can_swap_in(self, seq_id: int, reserve: int = 0) -> bool:
        return len(self.host_table(seq_id)) + reserve <= self.num_free_blocks

    def swap_in(self, seq_id: int) -> list[tuple[int, int]]:
        """Brings ``seq_id``'s KV back into fresh device blocks; returns (host, device)."""
        host, num_registered = self._host.give_back(seq_id)
        device = self._pool.take(len(host))
        released = self._released.get(seq_id, 0)
        # Released entries: any id in range (never read); the first block's.
        self._tables[seq_id] = [device[0]] * released + device if released else device
        # Registration continues where it was (the swapped-in copies stay unindexed).
        self._num_registered[seq_id] = num_registered
        return list(zip(host, device, strict=True))

    # -- checks -------------------------------------------------------------------------

    def assert_invariants(self) -> None:
        owners = collections.Counter(b for s, t in self._tables.items()
                                     for b in t[self._released.get(s, 0):])
        self._pool.assert_invariants(owners)
        self._host.assert_invariants()


# Sliding windows and the KV pool: what a window lets the block manager give back.
#
# Where every layer attends to at most ``window`` trailing positions, a block wholly before
# the window of the earliest query a sequence can still make holds KV no layer reads again.
# Growing a sequence's table releases such blocks (as ``free`` would: a hashed one stays
# cached). Their entries stay in the table, so positions keep their indices and the
# executor's copy of the table (sent as appends) stays the same; every attention kernel
# reads only a row's window (kernels/attention.py), so those entries are never read,
# whoever owns the block now. A sequence then holds at most ``max_live`` blocks, what
# admission and the pool-size checks ask for (``BlockManager.blocks_needed``).
class KVWindow:
    """A window of ``window`` tokens (> 0) over a pool of ``num_blocks`` blocks of
    ``block_size``. ``step_cap``: the scheduler computes no more than that for one
    sequence in a step, so that its span fits the pool (``max_step_tokens``, the most
    one step computes for a sequence, or less; where even one token's span does not
    fit, a sequence is bounded by the pool as without a window). ``max_live``: the most
    blocks a sequence then holds at once."""

    __slots__ = ("window", "block_size", "step_cap", "max_live")

    def __init__(self, window: int, num_blocks: int, block_size: int,
                 max_step_tokens: int = 0) -> None:
        assert window > 0
        self.window = window
        self.block_size = block_size
        fits = (num_blocks - 1) * block_size - window  # largest step whose span fits
        self.step_cap = max(1, min(max_step_tokens, fits) if max_step_tokens else fits)
        self.max_live = -(-(window + self.step_cap) // block_size) + 1

    def behind(self, first_query: int) -> int:
        """How many leading blocks of a table lie wholly before the window of a query at
        ``first_query`` (one position more is kept than the window reads); negative
        early on."""
        return (first_query - self.window) // self.block_size


# The host (swap) pool: host blocks a swapped-out sequence's KV is copied into.
#
# BlockManager moves a sequence between the device and this
# pool (``swap_out``/``swap_in``); the pool keeps the free host blocks, each swapped
# sequence's host table, and how far its blocks had been considered for the prefix index
# when it left, so registration resumes where it was.
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
