"""Steps 4–5 of an iteration: resumed, then fresh requests leave the waiting queue for
the running set, in the queue's order (the policy picks within a lane, core/policy.py),
while the slots, the step's token budget and the KV pool allow.

The blocks kept free for the running ones are the watermark, and at least a block for
each running decode's next one (admitting into that block would preempt a stream
mid-answer at its next block boundary), plus the blocks the running prefills will still
take. The best request that does not fit stops admission: nobody overtakes it. What the
step left waiting, and why, is recorded for Submit's estimate (core/admission.py) and
for priority hold (core/priority_hold.py).
"""

from __future__ import annotations

from scheduler_svc.core.admission import Admission
from scheduler_svc.core.lifecycle import Lifecycle
from scheduler_svc.core.plan import Event, StepRecord
from scheduler_svc.core.priority_hold import PriorityHold
from scheduler_svc.core.request import SWAPPED, FinishReason, Request


class Admitter:
    """Admits into a step through the lifecycle's transitions (``start``, ``swap_in``);
    sheds what admission refuses on the way (``Admission.rejudge`` and ``overdue``)."""

    __slots__ = ("_lifecycle", "_admission", "_hold")

    def __init__(self, lifecycle: Lifecycle, admission: Admission, hold: PriorityHold) -> None:
        self._lifecycle = lifecycle
        self._admission = admission
        self._hold = hold

    def admit(self, rec: StepRecord, budget: int, cap: int, prefills: list[Request],
              step: int, events: list[Event]) -> int:
        """Admits into step ``step`` (``rec``); ``prefills`` are the running sequences
        still prefilling. Returns the budget left; ends go to ``events``."""
        lc, admission, hold = self._lifecycle, self._admission, self._hold
        bm = lc.block_manager
        running = lc.running_set.order
        reserve = max(admission.watermark_blocks(bm), len(running) - len(prefills))
        reserve += sum(bm.num_new_blocks(r.seq_id, len(r.token_ids)) for r in prefills)
        hold.reserve, hold.blocked = reserve, None
        now = admission.now = lc.clock()
        shed = admission.rejudge()  # blind admissions an estimate now refuses
        shed += [r for r in admission.overdue(now) if r not in shed]  # twice late
        for req in shed:
            lc.end_waiting(req, FinishReason.ABORT)
            events.append(Event(req, None, FinishReason.ABORT))
        waiting, max_num_seqs = lc.waiting, lc.config.max_num_seqs
        while budget > 0 and len(running) < max_num_seqs:
            req = waiting.peek(now)
            if req is None or req in hold.held_back:
                # Preempted this step to make room for a better tier: resuming it at
                # once would undo that (and, its sample still pending when scheduling
                # ahead, sample that position twice).
                break
            if bm.blocks_needed(len(req.token_ids)) > bm.num_blocks:
                # Its context outgrew the pool while it ran (then it was preempted, or
                # the executor restarted): it can never resume in full, and nobody may
                # overtake it. The pool is its context limit, as for one running alone.
                lc.end_waiting(req, FinishReason.LENGTH)
                events.append(Event(req, None, FinishReason.LENGTH))
                continue
            # With nothing running the watermark protects no decode: a resumed context
            # that outgrew the pool minus the watermark comes back once the pool drains.
            keep = reserve if running else 0
            if req.status == SWAPPED:
                n, need = lc.swap_in(req, rec, budget, cap, keep, step)
            else:
                n, need = lc.start(req, rec, budget, cap, keep, step)
            if n == 0:
                hold.blocked, hold.blocked_need = req, need
                break  # the best request does not fit yet; nobody overtakes it
            budget -= n
        # Anything left waiting waits for room or for prefill throughput (a budget
        # spent on long prompts holds the queue as surely as a full pool): see Admission.
        admission.blocked = bool(waiting)
        hold.wants_room = admission.blocked and budget > 0  # room, not the budget
        return budget
