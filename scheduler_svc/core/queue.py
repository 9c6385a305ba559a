"""The waiting queue: tiers, aging, and fair sharing between tenants.

Order of admission (best first), computed for the head of each (tier, tenant) FIFO:

1. **Starving** requests — waited at least ``(tier + 1) × aging_s`` — in arrival order.
2. Then by **effective tier** ``max(min(tier, 1), tier − ⌊waited / aging_s⌋)``: aging
   lifts a request one tier per ``aging_s``, but only up to standard — premium is passed
   only through starvation (lifting all the way let a best-effort flood share premium's
   tier: p99 TTFT 7.2 s instead of 2.3 s, docs/simulator.md §5);
3. within a tier, **resumed** (preempted) requests before fresh ones;
4. then the tenant **served the fewest tokens** (a virtual token counter: a tenant that
   starts waiting is lifted to the smallest counter among waiting ones, so idling banks
   no credit);
5. then arrival time.

Per-tenant state lives only while a tenant has requests (``prune`` drops idle served
counters; by 4. that forgets only credit idling may not bank), so a stream of unique
tenant names costs neither memory nor per-step time.

Bound on waiting: a tier-t request is starving after (t + 1) × aging_s; from then on only
earlier starving requests and the resumed ones at the front of their lanes go ahead of
it, so it waits at most (t + 1) × aging_s plus the time to admit the at most
``max_num_waiting`` requests queued before it, whatever higher-priority traffic arrives.
"""

from __future__ import annotations

import collections
import collections.abc
from collections.abc import Callable

from scheduler_svc.core.request import WAITING, Request


class WaitingQueue:
    """Requests waiting for admission, fresh or preempted. ``pick`` (the policy's,
    core/policy.py) chooses within the lane that ranks first: its head by default."""

    def __init__(self, aging_s: float, pick: Callable[[collections.deque[Request], float,
                                                       float], Request] | None = None) -> None:
        self.aging_s = aging_s
        self.pick = pick or _head
        self._fifos: dict[tuple[int, str], collections.deque[Request]] = {}
        self._per_tenant: dict[str, int] = {}  # tenant → requests waiting (no zeros)
        self._per_tier: collections.Counter[int] = collections.Counter()
        self.served: dict[str, float] = {}  # tenant → tokens computed for it
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self):
        for fifo in self._fifos.values():
            yield from fifo

    def num_waiting(self, tenant: str) -> int:
        return self._per_tenant.get(tenant, 0)

    @property
    def num_tenants(self) -> int:
        """Tenants with a request waiting."""
        return len(self._per_tenant)

    def num_waiting_up_to(self, tier: int) -> int:
        """Requests waiting in tiers 0..``tier`` (those admitted before a fresh one of
        ``tier``, aging aside)."""
        return sum(n for t, n in self._per_tier.items() if t <= tier)

    def oldest_arrival_up_to(self, tier: int) -> float | None:
        """Arrival time of the longest-waiting request in tiers 0..``tier``, or None."""
        times = [fifo[0].arrival_time for (t, _), fifo in self._fifos.items() if t <= tier]
        return min(times) if times else None

    def oldest_arrival(self) -> float | None:
        """Arrival time of the longest-waiting request of any tier, or None."""
        times = [fifo[0].arrival_time for fifo in self._fifos.values()]
        return min(times) if times else None

    def overdue(self, now: float, limit_s: collections.abc.Callable[[int], float],
                since: float = 0.0) -> list[Request]:
        """Fresh requests (never run, no client has seen a token of theirs) that have
        waited longer than ``limit_s(tier)`` (0: no limit) since ``since`` or their
        arrival, whichever is later, oldest first per FIFO. A FIFO holds fresh requests
        in arrival order behind any preempted ones, so the scan stops at its first fresh
        request that is not overdue."""
        found = []
        for (tier, _), fifo in self._fifos.items():
            limit = limit_s(tier)
            if limit <= 0:
                continue
            for req in fifo:
                if req.num_preemptions or req.num_resumed_output_tokens or \
                        req.status != WAITING:
                    continue
                if now - max(req.arrival_time, since) <= limit:
                    break
                found.append(req)
        return found

    def prune(self, active: collections.abc.Container[str]) -> None:
        """Forgets the served counters of tenants neither waiting nor in ``active``
        (the running ones); see the module docstring for why that is fair."""
        per_tenant = self._per_tenant
        for tenant in [t for t in self.served if t not in per_tenant and t not in active]:
            del self.served[tenant]

    def push(self, req: Request, front: bool = False) -> None:
        """Queues ``req``; ``front`` for a preempted request (it keeps its place)."""
        if req.tenant not in self._per_tenant:
            waiting = [self.served.get(t, 0.0) for t in self._per_tenant]
            floor = min(waiting) if waiting else 0.0
            self.served[req.tenant] = max(self.served.get(req.tenant, 0.0), floor)
        key = (req.priority_tier, req.tenant)
        fifo = self._fifos.get(key)
        if fifo is None:
            fifo = self._fifos[key] = collections.deque()
        if front:
            fifo.appendleft(req)
        else:
            fifo.append(req)
        self._per_tenant[req.tenant] = self._per_tenant.get(req.tenant, 0) + 1
        self._per_tier[req.priority_tier] += 1
        self._len += 1

    def remove(self, req: Request) -> None:
        key = (req.priority_tier, req.tenant)
        fifo = self._fifos[key]
        fifo.remove(req)
        if not fifo:
            del self._fifos[key]
        left = self._per_tenant[req.tenant] - 1
        if left:
            self._per_tenant[req.tenant] = left
        else:
            del self._per_tenant[req.tenant]
        self._per_tier[req.priority_tier] -= 1
        self._len -= 1

    def peek(self, now: float) -> Request | None:
        """The request to admit next, or None when empty."""
        best, best_key = None, None
        order = self._order
        for fifo in self._fifos.values():
            head = fifo[0]
            key = order(head, now)
            if head.num_preemptions and key[0] and len(fifo) > 1:
                key = min(key, self._oldest_fresh_key(fifo, now))
            if best_key is None or key < best_key:
                best, best_key = fifo, key
        return None if best is None else self.pick(best, now, self.aging_s)

    def _oldest_fresh_key(self, fifo: collections.deque[Request], now: float) -> tuple:
        """Behind a lane's resumed requests, its oldest fresh one may be starving: the
        lane then ranks as starving (its resumed requests still go first, keeping their
        place, and the starving one right after them)."""
        for req in fifo:
            if not req.num_preemptions and req.status == WAITING:
                key = self._order(req, now)
                return key if not key[0] else (2,)
        return (2,)

    def best_tier(self) -> int:
        """The best (smallest) tier with a request waiting; call only when not empty."""
        return min(t for t, n in self._per_tier.items() if n)

    def order_key(self, req: Request, now: float, resumed: bool = False) -> tuple:
        """``req``'s place in the admission order (smaller goes first); ``resumed``: as
        if it were queued again after a preemption (core/priority_hold.py)."""
        key = self._order(req, now)
        if resumed and key[0] == 1:
            key = (*key[:2], False, *key[3:])
        return key

    def _order(self, req: Request, now: float) -> tuple:
        arrival = req.arrival_time
        waited = now - arrival
        tier = req.priority_tier
        if waited >= (tier + 1) * self.aging_s:
            return (0, arrival)
        effective = tier - int(waited // self.aging_s)
        floor = 1 if tier else 0  # aging stops at standard: see the module docstring
        fresh = req.num_preemptions == 0 and req.status == WAITING
        return (1, effective if effective > floor else floor, fresh,
                self.served.get(req.tenant, 0.0), arrival)

    def charge(self, tenant: str, num_tokens: int) -> None:
        """Counts tokens computed for ``tenant`` (the fairness currency)."""
        self.served[tenant] = self.served.get(tenant, 0.0) + num_tokens


def _head(lane: collections.deque[Request], now: float, aging_s: float) -> Request:
    return lane[0]
