"""Steps planned and not yet answered, and what their answers still owe.

Scheduling ahead, a step is built while earlier ones run. Until ``update`` applies its
answer, or the plan is voided (a resync, a new executor), its StepRecord is kept here.
A sequence that leaves the running set meanwhile is marked in each (``left_running``:
its samples there need the full checks); one preempted while its sample from such a
step was pending is kept in ``awaiting``, because that sample still counts (a
synchronous scheduler would have had it before preempting).
"""

from __future__ import annotations

import collections

from scheduler_svc.core.plan import SchedulerOutput, StepRecord
from scheduler_svc.core.request import Request


class Unanswered:
    """The one owner of the unanswered steps (``records``, oldest first) and of the
    preempted sequences whose pending sample still counts (``awaiting``, by seq id)."""

    __slots__ = ("records", "awaiting")

    def __init__(self) -> None:
        self.records: collections.deque[StepRecord] = collections.deque()
        self.awaiting: dict[int, Request] = {}

    def sent(self, rec: StepRecord) -> None:
        self.records.append(rec)

    def answered(self, out: SchedulerOutput) -> StepRecord | None:
        """The record of ``out``, now answered (None for a voided plan); it and every
        older one are no longer unanswered."""
        records = self.records
        rec = None
        for unanswered in records:
            if unanswered.plan is out:
                rec = unanswered
                break
        while records and records[0].step_id <= out.step_id:
            records.popleft()
        return rec

    def expected(self, step_id: int) -> bytes | None:
        """The packed ids of the sequences step ``step_id`` is to sample (StepRecord
        .sampler_bytes), or None when it is not unanswered."""
        for rec in self.records:
            if rec.step_id == step_id:
                return rec.sampler_bytes
        return None

    def drop_lists(self) -> list[int]:
        """The drop lists of every unanswered plan (a refused plan's must be sent again)."""
        return [seq_id for rec in self.records for seq_id in rec.plan.finished_seq_ids]

    def forget(self) -> None:
        """No answer will be applied to the plans built so far: their pending samples are
        dropped (every running sequence is recomputed from its token history)."""
        self.records.clear()
        self.awaiting.clear()

    def left_running(self, req: Request) -> None:
        for rec in self.records:
            rec.removed.add(req.seq_id)

    def preempted(self, req: Request) -> None:
        """``req`` was preempted: a sample of an unanswered step it was caught up for
        is still to come, and counts."""
        if self.records and req.num_computed_tokens == len(req.token_ids):
            self.awaiting[req.seq_id] = req
