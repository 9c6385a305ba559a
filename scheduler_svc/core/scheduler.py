"""The iteration scheduler: one call to ``schedule()`` is one batch plan.

Order of one iteration (docs/design.md §3):

1. aborts and finishes that arrived since the last step were applied
   already (``abort`` is immediate and idempotent);
2. running decodes, in priority order, one token each — preempting the
   lowest-priority unscheduled sequence (or itself) when no block is free;
3. running partial prefills continue, each capped by the policy's chunk;
4. resumed (preempted) sequences, then fresh admissions, in the waiting
   queue's order (tier, aging, tenant fairness), while ``max_num_seqs``, the
   token budget and the KV watermark allow; no admissions in a step that
   had to preempt for KV. Before step 2, a waiting request of a better tier
   that lacks a slot or KV preempts the worst running (core/priority_hold.py).

``schedule()`` returns the plan (immutable, core/plan.py) and keeps a StepRecord of
it until its answer (core/unanswered.py); ``update()`` applies the answer to that
record (core/results.py). Each piece of state has one owner: where a request is and
the executor's model and block manager (core/lifecycle.py, over the waiting queue,
the running set and its decodes), admission at Submit (core/admission.py), priority
hold (core/priority_hold.py), the suspects (core/isolation.py), what differs between
policies (core/policy.py); steps 1b–5 are core/batch.py's. This module keeps the
iteration's frame (``schedule`` → steps → ``update``), the request API and the
executor's attach, detach and resync.

The output is columnar (lists of ids and counts) because the per-step path
is hot: at 256 running sequences the whole schedule + update must stay in
the low hundreds of microseconds. For the same reason a sequence that just
decodes is not touched each step (it rides the step clock), the answer's samples for those
are applied column-wise, a prompt's block hashes are computed when it arrives, and
the blocks a sequence decodes are indexed in the prefix cache once, when it leaves
the running set.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence

from protos import seq_columns
from scheduler_svc.core.admission import Admission, QueueFull
from scheduler_svc.core.batch import BatchPlanner, step_cap
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.isolation import Isolation
from scheduler_svc.core.kv_events import KVEventLog
from scheduler_svc.core.lifecycle import Lifecycle
from scheduler_svc.core.plan import Event, ModelInfo, SchedulerOutput, StepRecord
from scheduler_svc.core.policy import Policy, make_policy
from scheduler_svc.core.priority_hold import PriorityHold
from scheduler_svc.core.request import FinishReason, Request, RequestStatus
from scheduler_svc.core.results import ResultApplier
from scheduler_svc.core.step_cost import StepCost, kv_tokens
from scheduler_svc.core.unanswered import Unanswered

__all__ = ["Event", "ModelInfo", "QueueFull", "Scheduler", "SchedulerOutput"]
log = logging.getLogger("scheduler.core")


def _as_list(column: Sequence[int]) -> list[int]:
    """``column`` as a list: a list as it is (the loop's, read once out of the result);
    a slice of a protobuf repeated field is one (built in C, a third faster than
    ``list()``); anything else whose slice is not is converted."""
    if column.__class__ is list:
        return column
    copy = column[:]
    return copy if copy.__class__ is list else list(copy)


class Scheduler:
    """Owns every request's state and the block pool of the current executor.

    Not thread-safe by design: one loop owns it and calls it between steps.
    """

    def __init__(self, config: SchedulerConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # Steps planned and not yet answered (update) nor voided: a refused plan's drop
        # list (finished_seq_ids) is sent again. More than one only when scheduling ahead.
        self.unanswered = Unanswered()
        # The lifecycle owns where each request is and the executor's model and blocks;
        # these names read its objects (never replaced).
        self.lifecycle = lc = Lifecycle(config, clock, self.unanswered)
        self.waiting, self.running_set, self.decodes = lc.waiting, lc.running_set, lc.decodes
        self.running = self.running_set.order  # priority order: (tier, admission)
        self.requests = lc.requests  # every live request, by id
        self.admission = Admission(config, self.waiting, self.running_set)
        lc.on_served = self.admission.finished  # Little's law's W and L, as requests end
        self.hold = PriorityHold()
        self.batch = BatchPlanner(lc, self.admission, self.hold, self.unanswered)
        self.isolation = Isolation(lc)
        self.results = ResultApplier(self.running_set, self.unanswered, lc.end_running,
                                     lc.end_waiting)
        self._events: list[Event] = []
        self._step_id = 0
        self.step_cost = StepCost()  # fed by observe_step: the SLO-aware token budget's
        self.policy: Policy | None = None
        self.kv_events: KVEventLog | None = None  # set before attach: index changes go there
        self.reconfigure(config)

    def reconfigure(self, config: SchedulerConfig) -> None:
        """Replaces the config between steps (hot reload); each component is handed the
        fields it reads (docs/style.md habit 6)."""
        self.config = config
        self.policy = make_policy(config, self.policy)
        self.waiting.aging_s = config.aging_s
        self.waiting.pick = self.policy.pick
        self.admission.config = config
        self.lifecycle.config = config

    @property
    def model(self) -> ModelInfo | None:
        """The current executor's (core/lifecycle.py owns it); None while there is none."""
        return self.lifecycle.model

    @property
    def block_manager(self) -> BlockManager | None:
        """The current executor's KV pool (core/lifecycle.py owns it)."""
        return self.lifecycle.block_manager

    @property
    def num_prefill_alerts(self) -> int:
        """Steps past SchedulerConfig.prefill_alert_tokens."""
        return self.batch.num_prefill_alerts

    @property
    def num_finished(self) -> int:
        return self.lifecycle.num_finished

    @property
    def num_preemptions(self) -> int:
        return self.lifecycle.num_preemptions

    @property
    def preemptions_by_reason(self) -> collections.Counter[str]:
        return self.lifecycle.preemptions_by_reason

    @property
    def num_recomputed_tokens(self) -> int:
        return self.lifecycle.num_recomputed_tokens

    @property
    def num_shed(self) -> int:
        return self.admission.num_shed

    @property
    def num_columnar_updates(self) -> int:
        return self.results.num_columnar_updates

    @property
    def num_update_fallbacks(self) -> int:
        return self.results.num_update_fallbacks

    # -- executor lifecycle ------------------------------------------------------------

    def attach_executor(self, model: ModelInfo) -> None:
        """A new executor incarnation: its KV cache is empty, so every running or
        swapped sequence goes back to the queue to be recomputed."""
        self.lifecycle.attach(model, self.kv_events)
        self.admission.serving_since = None  # set by the first admission step

    def detach_executor(self) -> None:
        """The executor is gone: nothing runs until ``attach_executor``."""
        self.lifecycle.detach(self.kv_events)

    def resync(self) -> None:
        """The executor refused a plan: drop everything it holds and recompute
        every running sequence from the authoritative token history.

        The refused plan wrote no KV and copied no block, yet building it
        registered the blocks it was to fill in the prefix cache, sent its
        swap-outs and its drop list: so the cache forgets every block, swapped
        sequences are recomputed too, and the drop list is sent again. Plans built
        after it (scheduling ahead) are void too: answers to them must not be applied
        (the caller ignores them), and their drop lists are sent again as well."""
        self.lifecycle.resync()

    # -- poison requests (core/isolation.py) -------------------------------------------

    @property
    def isolating(self) -> bool:
        """Some request failed a step and has not yet completed its steps of its own: the
        loop keeps one plan in flight, so such a step is built when nothing else runs."""
        return self.isolation.active

    def step_failed(self, out: SchedulerOutput, why: str) -> list[Event]:
        """The executor raised, hung or died running ``out``: every request in it failed a
        step (core/isolation.py); one that failed its last step alone is ended with ERROR
        and ``why``. Call it before ``resync``/``detach_executor`` (which recompute the
        rest). Returns the ended requests' events."""
        scheduled = [req for req, _, _ in out.scheduled() if not req.is_finished]
        return self.isolation.step_failed(scheduled, why, self.config.max_step_failures)

    def row_failed(self, seq_id: int, why: str, invalid_input: bool) -> Event | None:
        """Ends the running sequence ``seq_id`` whose own row failed in a step that stood
        (core/isolation.py); call it before ``update`` applies that step. None when it is
        no longer running (aborted while the step ran)."""
        req = self.running_set.by_seq.get(seq_id)
        return None if req is None else self.isolation.row_failed(req, why, invalid_input)

    # -- requests ----------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queues ``req``; raises QueueFull when a cap is reached or it would wait past
        its tier's bound (core/admission.py)."""
        assert req.request_id not in self.requests, "duplicate request id"
        self.admission.check_caps(req)
        req.arrival_time = req.arrival_time or self.clock()
        self.admission.refuse_overload(req, self.num_finished)
        if self.block_manager is not None:  # hash the prompt now, not in a step
            self.block_manager.extend_hashes(req.token_ids, req.block_hashes,
                                             len(req.token_ids) // self.model.block_size,
                                             req.block_chunks)
        self.lifecycle.enqueue(req)
        self.hold.arrived(req, self.running, self.config.max_num_seqs)

    def admission_problem(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request can never be served by the current executor, or None."""
        if self.model is None:
            return None
        return self.admission.problem(self.block_manager, self.model.max_model_len,
                                      num_prompt_tokens, max_tokens)

    def abort(self, request_id: str) -> Event | None:
        """Aborts a request; idempotent (None when unknown or already done)."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        if req.status == RequestStatus.RUNNING:
            self.lifecycle.end_running(req, FinishReason.ABORT)
        else:
            self.lifecycle.end_waiting(req, FinishReason.ABORT)
        return Event(req, None, FinishReason.ABORT)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.lifecycle.to_drop)

    # -- one iteration -----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Builds the next step. Called while earlier steps are unanswered (``update``
        not yet called for them: scheduling ahead), it assumes every sequence they
        sample gets one more token and gives it its next decode now, unless that
        sample is certainly its last (its length limit); the executor computes it
        from the token it sampled itself. A sequence that turns out to have finished
        (a stop token) is dropped by the next plan and its extra sample ignored."""
        assert self.block_manager is not None, "schedule() without an executor"
        self._step_id += 1
        rec = StepRecord(self._step_id)
        isolation = self.isolation
        suspect = isolation.next() if isolation.active else None
        if suspect is None or self.unanswered.records or not isolation.plan(
                rec, suspect, self._step_id,
                step_cap(self.block_manager, self.policy.prefill_cap()), self.config,
                len(self.running), self._make_room, self._events):
            self.batch.plan(rec, suspect is None, self._step_id, self.config, self.policy,
                            self.step_cost, self._make_room, self._events)
        lc = self.lifecycle
        to_drop, lc.to_drop = lc.to_drop, []
        swap_out, lc.swap_out = lc.swap_out, []
        out = rec.freeze(to_drop, swap_out)
        if not out.is_empty:  # an empty plan is never sent, so never answered
            self.unanswered.sent(rec)
            rec.list_samplers()
        return out

    def _make_room(self, req: Request, num_tokens: int) -> bool:
        """Preempts until ``req`` can hold ``num_tokens`` positions (Lifecycle.make_room);
        False if ``req`` itself was preempted (or cannot progress this step)."""
        return self.lifecycle.make_room(req, num_tokens, self._step_id,
                                        self.policy.victim_key, self._events)

    # -- results -----------------------------------------------------------------------

    def update(self, out: SchedulerOutput, seq_ids: bytes | Sequence[int],
               token_ids: Sequence[int]) -> list[Event]:
        """Folds one step's sampled tokens in (ids packed or plain); returns what clients hear."""
        events, self._events = self._events, []
        rec = self.unanswered.answered(out)  # None for a voided plan
        if rec is not None and rec.isolated is not None:  # its step of its own succeeded
            self.isolation.solo_step_done(rec.isolated)
        if seq_ids.__class__ is bytes:  # packed: as planned, no id is read
            seq_ids = (rec.sampler_ids if rec is not None and seq_ids == rec.sampler_bytes
                       else seq_columns.unpack(seq_ids))
        else:  # plain lists first: iterating protobuf repeated fields costs twice as much
            seq_ids = _as_list(seq_ids)
        token_ids = _as_list(token_ids)
        results = self.results
        if rec is not None and (seq_ids is rec.sampler_ids or seq_ids == rec.sampler_ids):
            results.apply_columnar(rec, seq_ids, token_ids, events)
        else:
            # A sample is missing or unasked for: the bulk assumes each of its sequences
            # got the one it was planned, so each is checked again before it decodes.
            results.num_update_fallbacks += 1
            self.decodes.recheck_all()
            results.apply_samples(seq_ids, token_ids, events)
        if self.unanswered.awaiting:
            results.apply_awaiting(out.step_id, seq_ids, token_ids, events)
        return events

    def expected_samplers(self, step_id: int) -> bytes | None:
        """The packed ids unanswered step ``step_id`` is to sample (None: not one)."""
        return self.unanswered.expected(step_id)

    def observe_step(self, out: SchedulerOutput, elapsed_s: float) -> None:
        """One answered step's measured time: the SLO-aware budget's fit learns from it."""
        if self.block_manager is not None:
            self.step_cost.observe(out.num_batched_tokens - out.num_prefill_tokens,
                                   out.num_prefill_tokens, kv_tokens(self.block_manager),
                                   elapsed_s * 1e3)

    def take_events(self) -> list[Event]:
        """Events produced outside ``update`` (e.g. a request finished by schedule)."""
        events, self._events = self._events, []
        return events

    # -- introspection -----------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        bm = self.block_manager
        return {
            "num_waiting": len(self.waiting),
            "num_running": len(self.running),
            "num_total_blocks": bm.num_blocks if bm else 0,
            "num_free_blocks": bm.num_free_blocks if bm else 0,
        }

    def assert_invariants(self, out: SchedulerOutput | None = None) -> None:
        bm = self.block_manager
        if bm is not None:
            bm.assert_invariants()
        if out is not None:
            assert out.num_batched_tokens <= self.config.max_num_batched_tokens
            assert sum(n for _, n, _ in out.scheduled()) == out.num_batched_tokens
        assert len(self.running) <= self.config.max_num_seqs
        self.running_set.assert_invariants()
        self.decodes.assert_invariants(self.running, bm)
        ahead = 1 if self.unanswered.records else 0  # a decode of a pending sample
        for req in self.running:
            assert req.status == RequestStatus.RUNNING
            assert 0 <= req.num_computed_tokens <= len(req.token_ids) + ahead
        for req in self.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.SWAPPED)
            assert req.status == RequestStatus.SWAPPED or req.num_computed_tokens == 0
        assert len(self.requests) == len(self.running) + len(self.waiting)
