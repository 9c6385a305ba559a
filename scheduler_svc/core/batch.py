"""Steps 1b–5 of one iteration (docs/design.md §3), into the step's StepRecord.

1b. a better tier waiting for a slot or KV preempts the worst running, before any of
    them is given this step's decode (core/priority_hold.py);
2.  running decodes, one token each (core/decodes.py: the step clock's tick schedules
    them), preempting when no block is free;
3.  running partial prefills continue, within the policy's prompt bounds;
4–5. resumed, then fresh requests start (core/admit.py), unless the policy closes
    admission or the step had to preempt for KV.

The policy (core/policy.py) is asked for the prompt bounds and whether admission is
open; ``make_room`` (the scheduler's, over Lifecycle.make_room) preempts in its victim
order. Isolation's steps of their own (core/isolation.py) are planned elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from scheduler_svc.core.admission import Admission
from scheduler_svc.core.admit import Admitter
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.lifecycle import Lifecycle
from scheduler_svc.core.plan import Event, StepRecord
from scheduler_svc.core.policy import Policy
from scheduler_svc.core.priority_hold import PriorityHold
from scheduler_svc.core.request import RUNNING, Request
from scheduler_svc.core.step_cost import StepCost
from scheduler_svc.core.unanswered import Unanswered

log = logging.getLogger("scheduler.core")


def step_cap(block_manager, cap: int) -> int:
    """The per-sequence prompt cap, within what a sliding window's span lets the pool
    hold (BlockManager.step_cap)."""
    window_cap = block_manager.step_cap
    return min(cap, window_cap) if window_cap else cap


class BatchPlanner:
    """Plans a batched step; counts the steps whose prompt tokens passed
    ``prefill_alert_tokens`` (``num_prefill_alerts``)."""

    __slots__ = ("_lifecycle", "_admission", "_hold", "_admitter", "_unanswered",
                 "num_prefill_alerts")

    def __init__(self, lifecycle: Lifecycle, admission: Admission, hold: PriorityHold,
                 unanswered: Unanswered) -> None:
        self._lifecycle = lifecycle
        self._admission = admission
        self._hold = hold
        self._admitter = Admitter(lifecycle, admission, hold)
        self._unanswered = unanswered
        self.num_prefill_alerts = 0

    def plan(self, rec: StepRecord, admit: bool, step: int, cfg: SchedulerConfig,
             policy: Policy, fit: StepCost, make_room: Callable[[Request, int], bool],
             events: list[Event]) -> None:
        """Step ``step`` (``rec``) under ``cfg`` and ``policy``; ``fit`` is the online
        step-time fit. ``admit`` False while a suspect waits for a step of its own:
        nobody overtakes it, and the running sequences drain the pool for it."""
        lc = self._lifecycle
        bm, running_set, waiting = lc.block_manager, lc.running_set, lc.waiting
        num_running_at_start = len(running_set)
        hold = self._hold
        if admit and hold.pending and policy.admission_open(num_running_at_start):
            hold.hold(lc, self._admission.watermark_blocks(bm), cfg.max_num_seqs,
                      policy.victim_key)
        preempts_before = lc.num_preemptions  # KV preemptions close admission
        unanswered = self._unanswered.records
        if len(unanswered) > 1:
            # Two plans out already (never from the loop, which keeps two at most): no
            # decode goes further ahead, and the clock does not tick.
            prefills = sorted(lc.decodes.others, key=lambda r: r.running_key)
        else:
            prefills = lc.decodes.schedule(rec, bm, step, bool(unanswered), make_room)
            running_set.charge_decodes(waiting.charge, prefills)
        budget = cfg.max_num_batched_tokens - len(rec.cached)
        # Prompt tokens this step: the policy's (the clamp, or the SLO-aware budget).
        held, cap = policy.prompt_bounds(budget, len(rec.cached), prefills, fit,
                                         running_set.per_tier, bm, waiting, lc.clock)
        cap = step_cap(bm, cap)
        budget = self._prefills(rec, budget - held, prefills, cap, step, make_room)
        if admit and lc.num_preemptions == preempts_before and \
                policy.admission_open(num_running_at_start):
            budget = self._admitter.admit(rec, budget, cap, prefills, step, events)
        policy.step_planned(rec, lc.clock)
        rec.num_batched_tokens = cfg.max_num_batched_tokens - budget - held
        if 0 < cfg.prefill_alert_tokens < rec.num_prefill_tokens:
            self.num_prefill_alerts += 1
            if self.num_prefill_alerts % 1000 == 1:
                log.warning("prefill ceiling passed: %d prompt tokens in step %d (ceiling "
                            "%d; %d such steps)", rec.num_prefill_tokens, step,
                            cfg.prefill_alert_tokens, self.num_prefill_alerts)

    def _prefills(self, rec: StepRecord, budget: int, prefills: list[Request], cap: int,
                  step: int, make_room: Callable[[Request, int], bool]) -> int:
        """Step 3: running partial prefills continue, chunk-capped."""
        advance = self._lifecycle.advance
        for req in prefills:
            if budget <= 0:
                break
            if req.status != RUNNING:
                continue
            n = min(len(req.token_ids) - req.num_computed_tokens, budget, cap)
            if n <= 0 or not make_room(req, req.num_computed_tokens + n):
                continue
            rec.add_chunk(req, n, advance(req, n, step))
            rec.num_prefill_tokens += n
            budget -= n
        return budget
