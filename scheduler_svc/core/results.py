"""A step's answer: what the unanswered steps still owe (``Unanswered``), and applying an
answer (``ResultApplier``): the sampled tokens become history and client events.

When the answer's seq ids are exactly those expected (``StepRecord.sampler_ids``), it is
applied column-wise (``_apply_bulk``); any other answer goes through the per-sequence
checks (``apply_samples``).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable

from scheduler_svc.core.plan import Event, SchedulerOutput, StepRecord
from scheduler_svc.core.request import FinishReason, Request
from scheduler_svc.core.running import RunningSet

_repeat = itertools.repeat
_append = list.append
_consume = collections.deque(maxlen=0).extend  # runs an iterator, keeps nothing


# Steps planned and not yet answered, and what their answers still owe.
#
# Scheduling ahead, a step is built while earlier ones run. Until ``update`` applies its
# answer, or the plan is voided (a resync, a new executor), its StepRecord is kept here.
# A sequence that leaves the running set meanwhile is marked in each (``left_running``:
# its samples there need the full checks); one preempted while its sample from such a
# step was pending is kept in ``awaiting``, because that sample still counts (a
# synchronous scheduler would have had it before preempting).
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


class ResultApplier:
    """Folds sampled tokens into the running sequences (``running``) and the preempted
    ones whose sample was still pending (``unanswered.awaiting``). A request a token ends
    is ended through ``end_running`` / ``end_waiting`` (the lifecycle's transitions)."""

    def __init__(self, running: RunningSet, unanswered: Unanswered,
                 end_running: Callable[[Request, FinishReason], None],
                 end_waiting: Callable[[Request, FinishReason], None]) -> None:
        self._running_set = running
        self._by_seq = running.by_seq
        self._unanswered = unanswered
        self._end_running = end_running
        self._end_waiting = end_waiting
        self.num_columnar_updates = 0  # answers applied column-wise, and the rest
        self.num_update_fallbacks = 0

    def apply_columnar(self, rec: StepRecord, seq_ids: list[int], token_ids: list[int],
                       events: list[Event]) -> None:
        """The answer lists exactly ``rec.sampler_ids``."""
        self.num_columnar_updates += 1
        a = rec.num_new_samplers
        b = a + rec.num_bulk
        if a:
            self.apply_samples(seq_ids[:a], token_ids[:a], events)
        if b > a:
            self._apply_bulk(rec, token_ids if a == 0 and b == len(token_ids)
                             else token_ids[a:b], events)
        if b < len(seq_ids):
            self.apply_samples(seq_ids[b:], token_ids[b:], events)

    def apply_samples(self, seq_ids: list[int], token_ids: list[int],
                      events: list[Event]) -> None:
        """Samples one by one, with every check (the answer's non-bulk part). Their events
        are plain 4-tuples, as the bulk's: see Event (core/plan.py)."""
        append = events.append
        # Running sequences only: one aborted or preempted while the step ran is None.
        for req, token in zip(map(self._by_seq.get, seq_ids), token_ids, strict=True):
            if req is None:
                continue
            tokens = req.token_ids
            num_tokens = len(tokens)
            computed = req.num_computed_tokens
            if computed != num_tokens and computed != num_tokens + 1:
                continue  # a sample this step did not ask for (stale result)
            # (computed == num_tokens + 1: scheduled ahead, a later step already
            # computes this token.)
            tokens.append(token)
            if token in req.stop_ids or num_tokens >= req.length_limit - 1:
                reason = req.finish_reason_for(token)
                if reason is not None:
                    self._end_running(req, reason)
                append((req, token, reason, None))
            else:
                append((req, token, None, None))

    def _apply_bulk(self, rec: StepRecord, token_ids: list[int],
                    events: list[Event]) -> None:
        """Samples of the plan's bulk, columnar. Each is still running unless listed in
        ``rec.removed`` and its sample is the one planned, so only a stop token, or a
        sample the calendar knew was its last by length (``rec.length_ends``), needs a
        look at the sequence itself."""
        n = rec.num_bulk
        cuts: list[int] = []
        if rec.removed:
            ids = rec.cached_seq_ids
            for seq_id in rec.removed:
                try:
                    cuts.append(ids.index(seq_id, 0, n))
                except ValueError:
                    pass
            cuts.sort()
        lo = 0
        for cut in cuts:
            self._apply_bulk_run(rec, token_ids, lo, cut, events)
            self.apply_samples([rec.cached_seq_ids[cut]], [token_ids[cut]], events)
            lo = cut + 1
        self._apply_bulk_run(rec, token_ids, lo, n, events)

    def _apply_bulk_run(self, rec: StepRecord, token_ids: list[int], lo: int, hi: int,
                        events: list[Event]) -> None:
        if lo >= hi:
            return
        if lo == 0 and hi == len(token_ids) == len(rec.cached):  # the whole plan: no copies
            tokens, reqs, histories = token_ids, rec.cached, rec.bulk_token_lists
        else:
            tokens, reqs = token_ids[lo:hi], rec.cached[lo:hi]
            histories = rec.bulk_token_lists[lo:hi]
        _consume(map(_append, histories, tokens))  # each history gets its token
        base = len(events)
        # Plain 4-tuples, not Events, here too.
        events.extend(zip(reqs, tokens, _repeat(None), _repeat(None), strict=False))
        stop = self._running_set.stop_union
        if not stop.isdisjoint(tokens):
            for i in itertools.compress(range(hi - lo), map(stop.__contains__, tokens)):
                req, token = reqs[i], tokens[i]
                if token in req.stop_ids:
                    self._end(req, token, events, base + i)
        for i in rec.length_ends:
            if lo <= i < hi:
                req = reqs[i - lo]
                if not req.is_finished:
                    self._end(req, tokens[i - lo], events, base + i - lo)

    def _end(self, req: Request, token: int, events: list[Event], at: int) -> None:
        """Ends ``req`` if ``token`` (its last, appended) does; its event at ``at`` says so."""
        reason = req.finish_reason_for(token)
        if reason is not None:
            self._end_running(req, reason)
            events[at] = (req, token, reason, None)

    def apply_awaiting(self, step_id: int, seq_ids: list[int], token_ids: list[int],
                       events: list[Event]) -> None:
        """Samples of step ``step_id`` for sequences preempted after it was sent."""
        awaiting = self._unanswered.awaiting
        for seq_id, token in zip(seq_ids, token_ids, strict=True):
            req = awaiting.get(seq_id)
            if req is None or req.scheduled_step != step_id or req.is_finished:
                continue
            del awaiting[seq_id]
            req.token_ids.append(token)
            reason = req.finish_reason_for(token)
            if reason is not None:
                self._end_waiting(req, reason)
            events.append((req, token, reason, None))
        for seq_id, req in list(awaiting.items()):
            if req.scheduled_step <= step_id:  # its sample was lost with the step
                del awaiting[seq_id]
