"""Python's cyclic garbage collector, run while the executor computes instead of inside a
step.

Left automatic, collections land in the step's own work (it allocates the most), and a
full one traverses every request's lists: bench_scheduler's mix at 256 running measured
p99 535-749 µs and a worst step of 2.8-4.4 ms with it, 441 µs and 0.67 ms without
(``benchmarks/bench_scheduler.py --gc``).

``GcPacer.take_over`` freezes what start-up allocated, turns automatic collection off,
and the loop calls ``collect_if_due`` where nothing waits on this CPU (plans sent, answer
not back; going idle). Which generation follows CPython's own rule, so garbage is freed
as often as before. If answers are always back first, ``collect_if_due(False)`` collects
anyway past ``OVERDUE`` thresholds: memory stays bounded. Only the scheduler's entry
point takes over; tests keep automatic collection.
"""

from __future__ import annotations

import gc
import time

from runtime.gc_freeze import freeze_start_up

# With every answer back before the loop looks, collect on the step path after all once
# this many thresholds of allocations are pending.
OVERDUE = 20
# A full collection waits until the old generation grew by this fraction (CPython's rule).
FULL_GROWTH = 0.25


class GcPacer:
    """Counts what it collected: ``collections[generation]`` and ``seconds``. Like CPython,
    it counts the objects that survived into the old generation since its last full
    collection (``_pending``: the young generations' sizes before a collection of 1, less
    what it found unreachable) against the old generation's size then (``_old``)."""

    __slots__ = ("active", "collections", "seconds", "_thresholds", "_old", "_pending")

    def __init__(self) -> None:
        self.active = False
        self.collections = [0, 0, 0]
        self.seconds = 0.0
        self._thresholds = gc.get_threshold()
        self._old = self._pending = 0

    def take_over(self) -> int:
        """Freezes what is alive now and turns automatic collection off (the process's
        entry point calls it once start-up is done); returns how many objects it froze."""
        self._thresholds = gc.get_threshold()
        frozen = freeze_start_up()
        self._old, self._pending = len(gc.get_objects(2)), 0
        gc.disable()
        self.active = True
        return frozen

    def give_back(self) -> None:
        """Automatic collection again (what ``take_over`` froze stays frozen)."""
        if self.active:
            self.active = False
            gc.enable()

    def collect_if_due(self, waiting: bool = True) -> int | None:
        """Collects the generation due, if any; ``waiting``: nothing waits on this process
        now (else only an overdue collection runs). Returns the generation collected."""
        if not self.active:
            return None
        t0, t1, t2 = self._thresholds
        count0, count1, count2 = gc.get_count()
        if count0 <= (t0 if waiting else t0 * OVERDUE):
            return None
        generation = 0
        if count1 >= t1:
            generation = 2 if count2 >= t2 and self._pending > FULL_GROWTH * self._old else 1
        young = len(gc.get_objects(0)) + len(gc.get_objects(1)) if generation == 1 else 0
        start = time.perf_counter()
        found = gc.collect(generation)
        self.seconds += time.perf_counter() - start
        self.collections[generation] += 1
        if generation == 1:  # what it did not find unreachable is old now
            self._pending += max(0, young - found)
        elif generation == 2:
            self._old, self._pending = len(gc.get_objects(2)), 0
        return generation
