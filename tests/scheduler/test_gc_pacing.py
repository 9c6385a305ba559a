"""The scheduler's garbage-collection pacing (scheduler_svc/gc_pacing.py): once it takes
over, automatic collection is off, garbage cycles are still freed, by the generation
CPython's own rule picks, where the loop says nothing waits; with every answer back first,
an overdue collection still runs. Each test gives collection back to the interpreter."""

from __future__ import annotations

import gc
import weakref

import pytest

from scheduler_svc import gc_pacing
from scheduler_svc.gc_pacing import GcPacer


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref:
    """A two-object cycle nobody holds: only a collection frees it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def pacer():
    thresholds = gc.get_threshold()
    pacer = GcPacer()
    pacer.take_over()
    try:
        yield pacer
    finally:
        pacer.give_back()
        gc.set_threshold(*thresholds)
        gc.unfreeze()
        assert gc.isenabled()


def allocate(n: int) -> list:
    return [[] for _ in range(n)]  # tracked containers: each counts toward generation 0


def test_an_inactive_pacer_leaves_collection_automatic():
    pacer = GcPacer()
    assert gc.isenabled() and pacer.collect_if_due() is None
    pacer.give_back()  # a no-op
    assert gc.isenabled()


def test_taking_over_freezes_start_up_and_turns_automatic_collection_off(pacer):
    assert not gc.isenabled() and gc.get_freeze_count() > 0
    ref = cycle()
    keep = allocate(gc.get_threshold()[0] * 3)  # automatic collection would have run
    assert ref() is not None, "collected automatically after take_over"
    assert pacer.collect_if_due() == 0  # due: generation 0, where the loop calls it
    assert ref() is None and pacer.collections == [1, 0, 0] and pacer.seconds > 0
    assert pacer.collect_if_due() is None  # nothing due right after
    del keep


def test_below_the_threshold_nothing_runs(pacer):
    gc.collect(0)
    ref = cycle()
    assert pacer.collect_if_due() is None and ref() is not None
    assert pacer.collections == [0, 0, 0]


def test_with_the_answer_back_first_only_an_overdue_collection_runs(pacer):
    t0 = gc.get_threshold()[0]
    gc.collect(0)
    ref = cycle()
    keep = allocate(t0 * 2)
    assert pacer.collect_if_due(waiting=False) is None and ref() is not None
    keep += allocate(t0 * gc_pacing.OVERDUE)
    assert pacer.collect_if_due(waiting=False) == 0 and ref() is None


def test_older_generations_follow_cpythons_counts(pacer):
    """Generation 1 after threshold1 collections of 0; a full one after threshold2 of 1
    once the old generation grew by a quarter, and not before it grew."""
    t0, t1, t2 = gc.get_threshold()
    keep = []
    seen = []
    for _ in range(t1 * t2 * 2):
        keep += allocate(t0 + 1)
        seen.append(pacer.collect_if_due())
    assert seen[:t1] == [0] * t1 and seen[t1] == 1, seen[:t1 + 1]
    assert 2 in seen, "a full collection once the old generation grew"
    assert pacer.collections[2] >= 1 and pacer.collections[1] >= t2 - 1
    # Only garbage now (cycles, freed by the collections): nothing survives into the old
    # generation. A full collection the first half's last survivors are owed may come
    # once; after it, the counts pass threshold2 again and again without another.
    keep.clear()
    seen = []
    for _ in range(t1 * t2 * 3):
        for _ in range(t0 // 2 + 1):
            cycle()
        seen.append(pacer.collect_if_due())
    assert seen.count(2) <= 1 and None not in seen
    after = seen[seen.index(2) + 1:] if 2 in seen else seen
    assert after.count(1) > t2, after  # threshold2 passed, no full collection
