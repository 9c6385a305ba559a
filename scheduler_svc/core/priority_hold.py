"""Priority that holds when the batch is full (vllm-project/vllm#40004 in vLLM).

Without it a premium request waits behind ``max_num_seqs`` best-effort sequences (or a
pool they filled) until one finishes. So at the start of a step, before any decode is
planned (a victim chosen later would already hold a token of this step), the waiting
queue's best request may preempt running sequences of a strictly worse tier when it
lacks a slot or KV blocks:

* victims in the policy's victim order (core/preemption.py ``victim_key``), recompute or
  swap by the cost model (reason ``priority``);
* never a protected sequence (the thrash guard), never one that, queued again, would be
  admitted before the request it made room for (it would take its slot straight back);
* only as many as it needs, and none when all of them would not make it fit;
* one waiting request per step (a burst of N premium requests starts within N steps);
  a victim does not resume in the same step.

Triggered only when the last admission left a request without room, or a better tier
arrived to full slots; it costs the bench_scheduler step 0-2 %. The step's KV
preemptions (step 2) still close admission for the step (core/scheduler.py).
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler_svc.core import preemption
from scheduler_svc.core.lifecycle import Lifecycle
from scheduler_svc.core.request import SWAPPED, WAITING, Request


class PriorityHold:
    """What the last admission stage left for priority hold (the scheduler writes it):
    whether a request found no room (``wants_room``, also set by an arrival of a better
    tier to full slots), the blocks that admission kept free (``reserve``), the request
    that did not fit and its device blocks (``blocked``, ``blocked_need``; None, 0: the
    slots were short); and the sequences preempted for priority in this step
    (``held_back``: none of them resumes in this step's admission)."""

    __slots__ = ("wants_room", "reserve", "blocked", "blocked_need", "held_back")

    def __init__(self) -> None:
        self.wants_room = False
        self.reserve = 0
        self.blocked: Request | None = None
        self.blocked_need = 0
        self.held_back: set[Request] = set()

    @property
    def pending(self) -> bool:
        """``hold`` has something to do: a request wants room, or the last step's
        ``held_back`` is to be cleared."""
        return self.wants_room or bool(self.held_back)

    def arrived(self, req: Request, running: list[Request], max_num_seqs: int) -> None:
        """``req`` was queued: with no slot free, a better tier than the worst running may
        preempt at the next step."""
        if len(running) >= max_num_seqs and req.priority_tier < running[-1].priority_tier:
            self.wants_room = True

    def hold(self, lc: Lifecycle, watermark_blocks: int, max_num_seqs: int,
             victim_key: Callable[[Request], tuple]) -> int:
        """Preempts for the waiting queue's best request as the module docstring says;
        returns how many were preempted. Looks only when the last admission left a
        request without room or a better tier arrived to full slots, then at the worst
        running tier and the best waiting one before anything costlier; the request the
        last admission could not fit and its need are taken as admission counted them.
        ``watermark_blocks``: admission's; ``victim_key``: the policy's victim order."""
        if self.held_back:
            self.held_back.clear()
        if not self.wants_room:
            return 0
        self.wants_room = False  # the next admission that finds no room sets it again
        waiting, running = lc.waiting, lc.running_set.order
        head, need = self.blocked, self.blocked_need
        # The slots were short, or an arrival (no request left without blocks)?
        slots_short = head is None or (head.status is not WAITING and head.status is not SWAPPED)
        if slots_short and len(running) < max_num_seqs:
            return 0  # a slot came free since: admission tries (and records a KV need)
        if not running or not waiting or waiting.best_tier() >= running[-1].priority_tier:
            return 0
        now = lc.clock()
        if slots_short:
            head, need = waiting.peek(now), None
        if head.priority_tier >= running[-1].priority_tier:
            return 0  # the head is a starving request of a worse tier: it waits its turn
        bm = lc.block_manager
        # The blocks admission kept free for the running last time (the admission stage: the
        # watermark or a block per decode, plus the running prefills' blocks).
        reserve = max(self.reserve, watermark_blocks)
        if need is None:
            need = _blocks_needed(bm, head)
        short_slots = len(running) - max_num_seqs + 1
        short_blocks = need + reserve - bm.num_free_blocks
        if short_slots <= 0 and short_blocks <= 0:
            return 0  # it fits: admission starts it (or the budget did not reach it)
        victims = _victims(lc, head, now, short_slots, short_blocks, victim_key)
        for req in victims:
            lc.preempt(req, "priority")
        self.held_back.update(victims)  # none of them resumes in this step's admission
        return len(victims)


def _victims(lc: Lifecycle, head: Request, now: float, short_slots: int, short_blocks: int,
             victim_key: Callable[[Request], tuple]) -> list[Request]:
    """The fewest running sequences, in victim order, whose slots and blocks make room
    for ``head``; none when all of them would not."""
    bm, waiting, running = lc.block_manager, lc.waiting, lc.running_set.order
    tier = head.priority_tier
    i = len(running)  # the running set is in (tier, admission) order: worse tiers last
    while i and running[i - 1].priority_tier > tier:
        i -= 1
    head_key = waiting.order_key(head, now)
    victims: list[Request] = []
    freed = 0
    for req in preemption.in_victim_order(running, i, victim_key):
        if req.protected or waiting.order_key(req, now, resumed=True) <= head_key:
            continue
        victims.append(req)
        freed += bm.num_exclusive(req.seq_id)
        # Each victim frees a slot and its blocks, and one less decode to reserve for.
        if len(victims) >= short_slots and freed + len(victims) >= short_blocks:
            return victims
    return []  # even every eligible victim would not make room


def _blocks_needed(bm, req: Request) -> int:
    """Device blocks ``req`` takes to start (as ``Lifecycle.start``/``swap_in`` count);
    a look-up that does not count in the prefix cache's hit statistics."""
    total = bm.blocks_needed(len(req.token_ids))
    if req.status is SWAPPED:
        return total
    hits, _ = bm.num_cached_prefix(req.token_ids, req.block_hashes, req.block_chunks,
                                   count=False)
    return total - len(hits) + bm.num_unreferenced(hits)
