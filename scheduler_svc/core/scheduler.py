"""The iteration scheduler: one call to ``schedule()`` is one batch plan.

The order of one iteration is docs/design.md §3. ``schedule()`` runs the stages (hold,
decodes, prefills, admission; preemption is how a stage makes room), each writing its
part of one StepRecord; it returns the immutable plan (core/plan.py), and ``update()``
applies the answer to that record (core/results.py). Each piece of state has one owner:
where a request is (core/lifecycle.py), admission (core/admission.py), priority hold
(core/priority_hold.py), suspects (core/isolation.py), policy differences
(core/policy.py). This module keeps the iteration, the request API and the executor's
attach, detach and resync.

The output is columnar and a sequence that just decodes is not touched each step (it
rides the step clock) because the per-step path is hot: at 256 running sequences
schedule + update must stay in the low hundreds of microseconds.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence

from protos import seq_columns
from scheduler_svc.core.admission import Admission, QueueFull
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.isolation import Isolation
from scheduler_svc.core.kv_events import KVEventLog
from scheduler_svc.core.lifecycle import Lifecycle
from scheduler_svc.core.plan import Event, ModelInfo, SchedulerOutput, StepRecord
from scheduler_svc.core.policy import Policy, make_policy
from scheduler_svc.core.priority_hold import PriorityHold
from scheduler_svc.core.request import RUNNING, SWAPPED, FinishReason, Request, RequestStatus
from scheduler_svc.core.results import ResultApplier, Unanswered
from scheduler_svc.core.step_cost import StepCost, kv_tokens

__all__ = ["Event", "ModelInfo", "QueueFull", "Scheduler", "SchedulerOutput"]
log = logging.getLogger("scheduler.core")


def step_cap(block_manager: BlockManager, cap: int) -> int:
    """The per-sequence prompt cap, within what a sliding window's span lets the pool
    hold (BlockManager.step_cap)."""
    window_cap = block_manager.step_cap
    return min(cap, window_cap) if window_cap else cap


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
        self.num_prefill_alerts = 0  # steps past SchedulerConfig.prefill_alert_tokens
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

        Building the refused plan registered blocks in the prefix cache and sent
        swap-outs and a drop list that never happened: so the cache forgets every
        block, swapped sequences are recomputed too, and the drop lists of it and of
        the plans built after it (void: the caller ignores their answers) are resent."""
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
        return bool(self.waiting or self.running or self.lifecycle.owes_drops)

    # -- one iteration -----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Builds the next step: a suspect's step of its own (core/isolation.py), or the
        batched stages in the order of docs/design.md §3: 1b hold (core/priority_hold.py),
        2 decodes (core/decodes.py: the step clock's tick), 3 prefills, 4–5 admission
        (closed by the policy, or in a step that had to preempt for KV).

        Called while earlier steps are unanswered (scheduling ahead), it assumes every
        sequence they sample gets one more token, unless that sample is certainly its
        last; the executor computes it from the token it sampled itself. A sequence that
        turns out to have finished is dropped by the next plan, its extra sample ignored."""
        assert self.block_manager is not None, "schedule() without an executor"
        self._step_id += 1
        rec = StepRecord(self._step_id)
        isolation, cfg, policy = self.isolation, self.config, self.policy
        suspect = isolation.next() if isolation.active else None
        if suspect is None or self.unanswered.records or not isolation.plan(
                rec, suspect, rec.step_id, step_cap(self.block_manager, policy.prefill_cap()),
                cfg, len(self.running), lambda req, n: self._make_room(req, n, rec)):
            admit = suspect is None  # else nobody overtakes the suspect, and the running
            # sequences drain the pool for it
            num_running = len(self.running)
            admission_open = admit and policy.admission_open(num_running)
            if admission_open and self.hold.pending:
                self._hold()
            preempts_before = self.num_preemptions  # KV preemptions close admission
            prefills = self._decodes(rec)
            budget = cfg.max_num_batched_tokens - len(rec.cached)
            held, cap = policy.prompt_bounds(budget, len(rec.cached), prefills, self.step_cost,
                                             self.running_set.per_tier, self.block_manager,
                                             self.waiting, self.clock)
            cap = step_cap(self.block_manager, cap)
            budget = self._prefills(rec, budget - held, prefills, cap)
            if admission_open and self.num_preemptions == preempts_before:
                budget = self._admit(rec, budget, cap, prefills)
            policy.step_planned(rec, self.clock)
            rec.num_batched_tokens = cfg.max_num_batched_tokens - budget - held
            self._alert(rec)
        self._events += rec.ended
        out = rec.freeze(*self.lifecycle.take_owed())
        if not out.is_empty:  # an empty plan is never sent, so never answered
            self.unanswered.sent(rec)
            rec.list_samplers()
        return out

    def _make_room(self, req: Request, num_tokens: int, rec: StepRecord) -> bool:
        """Preempts until ``req`` can hold ``num_tokens`` positions (Lifecycle.make_room);
        False if ``req`` itself was preempted (or cannot progress this step)."""
        return self.lifecycle.make_room(req, num_tokens, rec, self.policy.victim_key)

    def _hold(self) -> None:
        """Stage 1b (core/priority_hold.py)."""
        self.hold.hold(self.lifecycle, self.admission.watermark_blocks(self.block_manager),
                       self.config.max_num_seqs, self.policy.victim_key)

    def _decodes(self, rec: StepRecord) -> list[Request]:
        """Stage 2: the bulk into ``rec`` (core/decodes.py); returns the running sequences
        that do not decode. With two plans out already (never from the loop, which keeps
        two at most) no decode goes further ahead, and the clock does not tick."""
        unanswered = self.unanswered.records
        if len(unanswered) > 1:
            return sorted(self.decodes.others, key=lambda r: r.running_key)
        prefills = self.decodes.schedule(rec, self.block_manager, rec.step_id,
                                         bool(unanswered),
                                         lambda req, n: self._make_room(req, n, rec))
        self.running_set.charge_decodes(self.waiting.charge, prefills)
        return prefills

    def _prefills(self, rec: StepRecord, budget: int, prefills: list[Request],
                  cap: int) -> int:
        """Stage 3: running partial prefills continue, chunk-capped; returns the budget
        left."""
        advance = self.lifecycle.advance
        for req in prefills:
            if budget <= 0:
                break
            if req.status is not RUNNING:
                continue
            n = min(len(req.token_ids) - req.num_computed_tokens, budget, cap)
            if n <= 0 or not self._make_room(req, req.num_computed_tokens + n, rec):
                continue
            rec.add_chunk(req, n, advance(req, n, rec.step_id))
            rec.num_prefill_tokens += n
            budget -= n
        return budget

    def _admit(self, rec: StepRecord, budget: int, cap: int, prefills: list[Request]) -> int:
        """Stages 4–5: resumed, then fresh requests leave the waiting queue for the
        running set, in the queue's order (the policy picks within a lane), while the
        slots, the budget and the KV pool allow; returns the budget left.

        Kept free: the watermark, a block for each running decode's next one (else a
        stream is preempted mid-answer at its next block boundary), and what running
        prefills will still take. The best request that does not fit stops admission
        (nobody overtakes it). What was left waiting, and why, is recorded for Submit's
        estimate and priority hold; what ``rejudge``/``overdue`` refuse is shed."""
        lc, admission, hold = self.lifecycle, self.admission, self.hold
        bm = lc.block_manager
        running = self.running
        reserve = max(admission.watermark_blocks(bm), len(running) - len(prefills))
        reserve += sum(bm.num_new_blocks(r.seq_id, len(r.token_ids)) for r in prefills)
        hold.reserve, hold.blocked = reserve, None
        now = admission.now = lc.clock()
        shed = admission.rejudge()  # blind admissions an estimate now refuses
        shed += [r for r in admission.overdue(now) if r not in shed]  # twice late
        for req in shed:
            lc.end_waiting(req, FinishReason.ABORT)
            rec.end(req, FinishReason.ABORT)
        waiting, max_num_seqs, step = lc.waiting, self.config.max_num_seqs, rec.step_id
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
                rec.end(req, FinishReason.LENGTH)
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

    def _alert(self, rec: StepRecord) -> None:
        cfg = self.config
        if 0 < cfg.prefill_alert_tokens < rec.num_prefill_tokens:
            self.num_prefill_alerts += 1
            if self.num_prefill_alerts % 1000 == 1:
                log.warning("prefill ceiling passed: %d prompt tokens in step %d (ceiling "
                            "%d; %d such steps)", rec.num_prefill_tokens, rec.step_id,
                            cfg.prefill_alert_tokens, self.num_prefill_alerts)

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
