"""What happened to the prefix-cache index, for routers that track it (KV events).

The block manager records here, in order, every change to its hash index (``stored``,
``removed``, ``cleared``); ``scheduler_svc/kv_events.py`` publishes them as vLLM's
``KVEventBatch`` for llm-d's prefix-cache scorer. Pure data: no zmq, no encoding.

Hashes are the chain hashes ``hash((parent_hash, tokens))`` of ints (root parent 0,
published as None); CPython does not seed int/tuple hashes, so they agree across
processes of one CPython version, and subscribers only pair them with earlier records.
With no log (``BlockManager(events=None)``) the hooks cost an ``is None`` test (no
change in ``make bench-scheduler --against`` beyond noise).
"""

from __future__ import annotations

from collections.abc import Callable

# One record: ("stored", block_hashes, parent_hash | None, token_ids, block_size)
#             ("removed", block_hashes) | ("cleared",)
KVRecord = tuple


class KVEventLog:
    """An append-only list of index changes since the last ``take``.

    ``on_first`` (optional) is called when a record lands in an empty log: the
    publisher uses it to flush once per step, after the step is built, without a
    hook in the loop. It must not touch the block manager. ``num_dropped``: records
    the publisher could not queue (its queue was full)."""

    __slots__ = ("num_dropped", "on_first", "records")

    def __init__(self, on_first: Callable[[], None] | None = None) -> None:
        self.records: list[KVRecord] = []
        self.on_first = on_first
        self.num_dropped = 0

    def _add(self, record: KVRecord) -> None:
        if not self.records and self.on_first is not None:
            self.on_first()
        self.records.append(record)

    def stored(self, block_hashes: list[int], parent: int, token_ids: list[int],
               block_size: int) -> None:
        """Consecutive full blocks of one sequence were indexed; ``parent`` is the
        chain hash before the first (0: the first block of a prompt)."""
        self._add(("stored", block_hashes, parent or None, token_ids, block_size))

    def removed(self, block_hashes: list[int]) -> None:
        self._add(("removed", block_hashes))

    def cleared(self) -> None:
        self._add(("cleared",))

    def take(self) -> list[KVRecord]:
        records, self.records = self.records, []
        return records


    def stored_runs(self, indices: list[int], hashes: list[int], token_ids: list[int],
                    block_size: int) -> None:
        """Records the blocks ``indices`` (ascending positions in one sequence, its
        chain ``hashes`` and ``token_ids``) as one ``stored`` per consecutive run: a
        block skipped (its hash was indexed already, by another block) breaks a run,
        and the next run names it as its parent."""
        start = prev = indices[0]
        for i in indices[1:] + [-1]:
            if i != prev + 1:
                self.stored(hashes[start:prev + 1], hashes[start - 1] if start else 0,
                            token_ids[start * block_size:(prev + 1) * block_size],
                            block_size)
                start = i
            prev = i
