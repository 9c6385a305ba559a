"""The running set: who holds device blocks and executor state, in priority order, and
the stop sets they end on (one object per distinct set, and their union for the
decode-mode bulk's stop filter, core/results.py)."""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable

from scheduler_svc.core.preemption import priority_key
from scheduler_svc.core.request import Request


class RunningSet:
    """The running sequences in priority order (tier, then admission), with a lookup by
    seq id and a count per tenant. ``order`` is the list itself (read it, never change
    it); ``add`` and ``remove`` keep the three views and ``Request.running_key`` (its
    ``priority_key`` as one int, so the order compares no tuples) in step."""

    __slots__ = ("order", "_keys", "by_seq", "per_tenant", "per_tier", "_admit_seq",
                 "_stop_sets", "stop_union")

    def __init__(self) -> None:
        self.order: list[Request] = []
        self._keys: list[int] = []  # their running_key, for bisect
        self.by_seq: dict[int, Request] = {}
        # No zero entries: unique tenant names must not grow the per-step loop.
        self.per_tenant: collections.Counter[str] = collections.Counter()
        self.per_tier: collections.Counter[int] = collections.Counter()  # zeros kept: <= 3
        self._admit_seq = 0
        self._stop_sets: dict[frozenset[int], frozenset[int]] = {}
        self.stop_union: frozenset[int] = frozenset()  # of every set in _stop_sets

    def __len__(self) -> int:
        return len(self.order)

    def add(self, req: Request) -> None:
        """``req`` starts running: it is the most recently admitted of its tier."""
        self._intern_stops(req)
        self._admit_seq += 1
        req.admit_seq = self._admit_seq
        tier, admitted = priority_key(req)
        key = req.running_key = (tier << 48) | admitted
        i = bisect.bisect(self._keys, key)
        self._keys.insert(i, key)
        self.order.insert(i, req)
        self.by_seq[req.seq_id] = req
        self.per_tenant[req.tenant] += 1
        self.per_tier[tier] += 1

    def _intern_stops(self, req: Request) -> None:
        """Requests share one object per distinct stop set (fewer cache lines per step),
        and every running one's is in ``stop_union``."""
        interned = self._stop_sets.get(req.stop_ids)
        if interned is None:
            if len(self._stop_sets) > 1024:
                self._stop_sets.clear()
                self.stop_union = frozenset().union(*(r.stop_ids for r in self.order))
            interned = self._stop_sets[req.stop_ids] = req.stop_ids
            self.stop_union |= interned
        req.stop_ids = interned

    def remove(self, req: Request) -> None:
        i = bisect.bisect_left(self._keys, req.running_key)
        assert self.order[i] is req
        del self.order[i]
        del self._keys[i]
        del self.by_seq[req.seq_id]
        self.per_tier[req.running_key >> 48] -= 1
        left = self.per_tenant[req.tenant] - 1
        if left:
            self.per_tenant[req.tenant] = left
        else:
            del self.per_tenant[req.tenant]

    def charge_decodes(self, charge: Callable[[str, int], None],
                       prefills: list[Request]) -> None:
        """Fairness accounting: one token per running decode, per tenant in
        O(tenants) rather than a dict update per sequence (a decode that lost
        its turn to preemption this step is still charged: an approximation
        the virtual token counter tolerates)."""
        for tenant, count in self.per_tenant.items():
            if count > 0:
                charge(tenant, count)
        for req in prefills:  # running but not decoding
            charge(req.tenant, -1)

    def assert_invariants(self) -> None:
        assert self._keys == sorted(self._keys)
        assert self._keys == [r.running_key for r in self.order]
        assert set(self.by_seq.values()) == set(self.order)
        assert sum(self.per_tenant.values()) == len(self.order)
        assert +self.per_tier == collections.Counter(r.running_key >> 48 for r in self.order)
