"""Applying a step's answer: the sampled tokens become history and client events.

The executor answers a plan with the seq ids that sampled and their tokens. When the
ids are exactly the ones the scheduler expected (``StepRecord.sampler_ids``: nothing
lost, nothing unasked), the answer is applied column-wise: the new sequences and the
prefill chunks one by one, the decode-mode bulk as columns (``_apply_bulk``). Any
other answer goes through the per-sequence checks (``apply_samples``).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable

from scheduler_svc.core.plan import Event, StepRecord
from scheduler_svc.core.request import FinishReason, Request
from scheduler_svc.core.running import RunningSet
from scheduler_svc.core.unanswered import Unanswered

_repeat = itertools.repeat
_append = list.append
_consume = collections.deque(maxlen=0).extend  # runs an iterator, keeps nothing


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
