"""The iteration scheduler: one call to ``schedule()`` is one batch plan.

Order of one iteration (DESIGN.md §3):

1. aborts and finishes that arrived since the last step were applied
   already (``abort`` is immediate and idempotent);
2. running decodes, in priority order, one token each — preempting the
   lowest-priority unscheduled sequence (or itself) when no block is free;
3. running partial prefills continue, each capped by the policy's chunk;
4. resumed (preempted) sequences, then fresh admissions, in the waiting
   queue's order (tier, aging, tenant fairness), while ``max_num_seqs``, the
   token budget and the KV watermark allow; no admissions in a step that
   had to preempt.

The output is columnar (lists of ids and counts) because the per-step path
is hot: at 256 running sequences the whole schedule + update must stay in
the low hundreds of microseconds. For the same reason a sequence that just
decodes is not touched each step (decode mode: ``_schedule_decodes``), the
answer's samples for those are applied column-wise (``_apply_bulk``), a
prompt's block hashes are computed when it arrives, and the blocks a sequence
decodes are indexed in the prefix cache once, when it leaves the running set.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import operator
import time
from collections.abc import Callable, Iterator, Sequence

from scheduler_svc.core.admission import (
    SHED_CHECK_S,
    SHED_FACTOR,
    ServiceTimes,
    ThroughputMeter,
    departure_rate,
    head_of_line_refusal,
    overload_refusal,
    shed_message,
)
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.config import SchedulerConfig, queue_time_bound
from scheduler_svc.core.policy import make_policy
from scheduler_svc.core.preemption import CostModel, pick_victim, priority_key
from scheduler_svc.core.queue import WaitingQueue
from scheduler_svc.core.request import DecodeClock, FinishReason, Request, RequestStatus

# (request, new token or None, finish reason or None): what a client must hear.
Event = tuple[Request, int | None, FinishReason | None]

_seq_id = operator.attrgetter("seq_id")
# priority_key as one int, set when it starts running (compares no tuples).
_order_key = operator.attrgetter("_order_key")
# Decode-mode calendar events, and the smallest block size decode mode is used for
# (below it every step is a boundary).
_DUE_START, _DUE_LEAVE = 0, 1
_MIN_DECODE_MODE_BLOCK = 2
# A suspect's steps of its own double with each failure, up to 2^this.
_MAX_SOLO_SHIFT = 6


class QueueFull(Exception):
    """Submit refused: a queue cap is reached. Retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the scheduler needs to know about the executor it plans for."""

    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    num_host_blocks: int = 0
    cost: CostModel = CostModel()


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    """One step's plan, columnar. ``new`` sequences travel in full."""

    step_id: int
    # (request, tokens scheduled this step) for sequences the executor lacks.
    new: list[tuple[Request, int]] = dataclasses.field(default_factory=list)
    cached: list[Request] = dataclasses.field(default_factory=list)
    cached_num_tokens: list[int] = dataclasses.field(default_factory=list)
    cached_num_new_blocks: list[int] = dataclasses.field(default_factory=list)
    cached_new_block_ids: list[int] = dataclasses.field(default_factory=list)
    finished_seq_ids: list[int] = dataclasses.field(default_factory=list)
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # device, host
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # host, device
    num_batched_tokens: int = 0
    num_prefill_tokens: int = 0
    # Columnar extras for the hot path (plan building and ``update``):
    cached_seq_ids: list[int] = dataclasses.field(default_factory=list)
    cached_prefills: list[Request] = dataclasses.field(default_factory=list)  # chunks, last
    # The first ``num_bulk`` of ``cached`` are decode-mode sequences (one token each,
    # each samples); ``bulk_token_lists`` are their token lists, in the same order.
    num_bulk: int = 0
    bulk_token_lists: list[list[int]] = dataclasses.field(default_factory=list)
    # The seq ids the executor's answer lists, in order, if every sample comes back;
    # the first ``num_new_samplers`` are new sequences, then the bulk decodes.
    sampler_ids: list[int] = dataclasses.field(default_factory=list)
    num_new_samplers: int = 0
    # Sequences that left the running set while it was unanswered (their samples
    # need the per-sequence checks).
    removed: set[int] = dataclasses.field(default_factory=set)
    # A suspect's step of its own (``Scheduler._isolate``): the only sequence in it.
    isolated: Request | None = None

    @property
    def is_empty(self) -> bool:
        return not (self.new or self.cached or self.finished_seq_ids or self.swap_out)

    def scheduled(self) -> Iterator[tuple[Request, int, bool]]:
        """(request, tokens this step, sent in full) for every scheduled sequence."""
        for req, n in self.new:
            yield req, n, True
        yield from ((r, n, False) for r, n in zip(self.cached, self.cached_num_tokens,
                                                   strict=True))


class Scheduler:
    """Owns every request's state and the block pool of the current executor.

    Not thread-safe by design: one loop owns it and calls it between steps.
    """

    def __init__(self, config: SchedulerConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.model: ModelInfo | None = None
        self.block_manager: BlockManager | None = None
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []  # priority order: (tier, admission)
        self._running_keys: list[int] = []  # their _order_key, for bisect
        self._by_seq: dict[int, Request] = {}  # running only
        # Decode mode (see _schedule_decodes): running sequences that decode one token a
        # step advance by the shared clock; the rest of the running set is "explicit"
        # and scheduled one by one. _due: clock epoch → the decode-mode sequences whose
        # token at that epoch's schedule() starts a block, or that must leave.
        self._clock = DecodeClock()
        self._dm_ids: dict[Request, int] = {}
        self._dm_tokens: dict[Request, list[int]] = {}
        self._explicit: dict[Request, None] = {}
        self._due: dict[int, list[Request]] = {}
        self._running_per_tenant: collections.Counter[str] = collections.Counter()
        self._to_drop: list[int] = []
        # Plans built and not yet answered (update) nor voided: a refused plan's drop list
        # (finished_seq_ids) is sent again. More than one only when scheduling ahead.
        self._unconfirmed: collections.deque[SchedulerOutput] = collections.deque()
        # Preempted while their sample from an unanswered step was pending: that sample
        # still counts (a synchronous scheduler would have had it before preempting).
        self._awaiting: dict[int, Request] = {}
        self._swap_out: list[tuple[int, int]] = []
        # Requests in a failed step, not yet through a step of their own (step_failed).
        self._suspects: dict[Request, None] = {}
        self._events: list[Event] = []
        self._step_id = 0
        self._stop_sets: dict[frozenset[int], frozenset[int]] = {}
        self._stop_union: frozenset[int] = frozenset()  # of every set in _stop_sets
        self._hashed_block_size = 0  # the block size of every request's block_hashes
        self._admit_seq = 0
        self.num_finished = 0
        self.num_columnar_updates = 0  # update() fast path, and the rest
        self.num_update_fallbacks = 0
        self.num_preemptions = 0
        self.preemptions_by_reason: collections.Counter[str] = collections.Counter()
        self.reconfigure(config)
        self.waiting = WaitingQueue(config.aging_s)
        self._throughput = ThroughputMeter()  # departures/s while saturated (admission)
        self._service = ServiceTimes()  # how long finished requests ran (admission)
        self.num_shed = 0  # queued requests ended for waiting past their bound
        self._next_shed_check = 0.0
        self._now = 0.0  # the clock at the last admission (step-granular timestamps)

    def reconfigure(self, config: SchedulerConfig) -> None:
        """Replaces the config between steps (hot reload)."""
        self.config = config
        self.policy = make_policy(config)
        if hasattr(self, "waiting"):
            self.waiting.aging_s = config.aging_s

    # -- executor lifecycle ------------------------------------------------------------

    def attach_executor(self, model: ModelInfo) -> None:
        """A new executor incarnation: its KV cache is empty, so every running or
        swapped sequence goes back to the queue to be recomputed."""
        self._reset_kv()
        if model.block_size != self._hashed_block_size:  # block hashes depend on it
            for req in self.requests.values():
                req.block_hashes.clear()
            self._hashed_block_size = model.block_size
        self.model = model
        self.block_manager = BlockManager(model.num_blocks, model.block_size,
                                          model.num_host_blocks,
                                          self.config.enable_prefix_caching)

    def detach_executor(self) -> None:
        """The executor is gone: nothing runs until ``attach_executor``."""
        self._reset_kv()
        self.model = None
        self.block_manager = None

    def resync(self) -> None:
        """The executor refused a plan: drop everything it holds and recompute
        every running sequence from the authoritative token history.

        The refused plan wrote no KV and copied no block, yet building it
        registered the blocks it was to fill in the prefix cache, sent its
        swap-outs and its drop list: so the cache forgets every block, swapped
        sequences are recomputed too, and the drop list is sent again. Plans built
        after it (scheduling ahead) are void too: answers to them must not be applied
        (the caller ignores them), and their drop lists are sent again as well."""
        for unanswered in self._unconfirmed:
            self._to_drop.extend(unanswered.finished_seq_ids)
        self._forget_unconfirmed()
        for req in list(reversed(self.running)):
            self._preempt(req, "resync", allow_swap=False, index=False)
        for req in self.waiting:
            if req.status == RequestStatus.SWAPPED:
                self.block_manager.free(req.seq_id)
                req.status, req.num_computed_tokens = RequestStatus.WAITING, 0
        self.block_manager.forget_cached()

    # -- poison requests -----------------------------------------------------------------

    @property
    def isolating(self) -> bool:
        """Some request failed a step and has not yet completed its steps of its own: the
        loop keeps one plan in flight, so such a step is built when nothing else runs."""
        return bool(self._suspects)

    def step_failed(self, out: SchedulerOutput, why: str) -> list[Event]:
        """The executor raised, hung or died running ``out``: every request in it failed a
        step. Call it before ``resync``/``detach_executor`` (which recompute the rest).

        A request that failed becomes a suspect: it runs next in steps of its own (no
        other sequence in them, ``_isolate``), 2^(f-1) of them after its f-th failure,
        so a fault that only a later position of it triggers is met alone too. Only a
        failure of a step it ran alone can end it: its ``max_step_failures``-th failure
        ends it with ERROR and ``why``. A healthy request thus never fails alone because
        of another, and a poisoned batch costs its culprit's K failures plus one step of
        its own for each other request. Returns the ended requests' events."""
        events: list[Event] = []
        scheduled = [req for req, _, _ in out.scheduled() if not req.is_finished]
        for req in scheduled:
            req.num_failed_steps += 1
            if len(scheduled) > 1 or req.num_failed_steps < self.config.max_step_failures:
                req.num_solo_steps_due = 1 << min(req.num_failed_steps - 1, _MAX_SOLO_SHIFT)
                self._suspects[req] = None
                continue
            if req.status == RequestStatus.RUNNING:
                self._remove_running(req, index=False)  # its blocks may hold no KV
            else:
                self.waiting.remove(req)
            req.error = (f"the executor failed {req.num_failed_steps} times while "
                         f"computing this request, the last time alone ({why}); it was "
                         "ended so that the other requests could go on")
            self._finish(req, FinishReason.ERROR)
            events.append((req, None, FinishReason.ERROR))
        return events

    def _next_suspect(self) -> Request | None:
        """The suspect whose steps of its own have begun, else the first waiting one."""
        first = None
        for req in self._suspects:
            if req.status == RequestStatus.RUNNING:
                return req
            first = first or req
        return first

    def _isolate(self, out: SchedulerOutput, req: Request) -> bool:
        """Plans a step of ``req`` alone (the running ones wait a step); False when it
        cannot start yet (the pool or max_num_seqs is full: then steps without
        admissions free room for it)."""
        bm = self.block_manager
        cap = self.policy.prefill_cap(self.config)
        budget = self.config.max_num_batched_tokens
        if req.status == RequestStatus.RUNNING:
            return self._isolate_running(out, req, budget, cap)
        if len(self.running) >= self.config.max_num_seqs:
            return False
        if bm.blocks_needed(len(req.token_ids)) > bm.num_blocks:
            self.waiting.remove(req)  # it can never resume in full (as in _admit)
            self._finish(req, FinishReason.LENGTH)
            self._events.append((req, None, FinishReason.LENGTH))
            return False
        if req.status == RequestStatus.SWAPPED:
            n = self._swap_in(req, out, budget, cap, 0)
        else:
            n = self._start(req, out, budget, cap, 0)
        if n:
            out.isolated = req
        return n > 0

    def _isolate_running(self, out: SchedulerOutput, req: Request, budget: int,
                         cap: int) -> bool:
        """The next step of a running suspect (explicit: it never entered decode mode)."""
        n = min(len(req.token_ids) - req.num_computed_tokens, budget, cap)
        if n <= 0:  # no sample came for it: nothing to run alone, let it batch
            self._suspects.pop(req, None)
            return False
        if not self._make_room(req, req.num_computed_tokens + n):
            return False  # preempted itself (or ended): it starts alone again later
        new = self._advance(req, n)
        out.cached.append(req)
        out.cached_seq_ids.append(req.seq_id)
        out.cached_prefills.append(req)  # samples iff it completes (_list_samplers)
        out.cached_num_tokens.append(n)
        out.cached_num_new_blocks.append(len(new))
        out.cached_new_block_ids.extend(new)
        out.num_batched_tokens = n
        if n > 1 or req.num_computed_tokens < len(req.token_ids):
            out.num_prefill_tokens += n
        out.isolated = req
        return True

    def _solo_step_done(self, req: Request) -> None:
        req.num_solo_steps_due -= 1
        if req.num_solo_steps_due <= 0:
            self._suspects.pop(req, None)

    def _reset_kv(self) -> None:
        for req in list(reversed(self.running)):
            self._preempt(req, "executor_restart", allow_swap=False, index=False)
        for req in list(self.waiting):
            if req.status == RequestStatus.SWAPPED:
                req.status, req.num_computed_tokens = RequestStatus.WAITING, 0
        self._to_drop.clear()
        self._forget_unconfirmed()
        self._swap_out.clear()

    def _forget_unconfirmed(self) -> None:
        """No answer will be applied to the plans built so far: their pending samples are
        dropped (every running sequence is recomputed from its token history)."""
        self._unconfirmed.clear()
        self._awaiting.clear()

    # -- requests ----------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queues ``req``; raises QueueFull when a cap is reached."""
        assert req.request_id not in self.requests, "duplicate request id"
        cfg = self.config
        if len(self.waiting) >= cfg.max_num_waiting:
            raise QueueFull(f"the queue is full ({cfg.max_num_waiting} requests waiting)",
                            self._retry_after())
        cap = cfg.max_num_waiting_per_tenant
        if cap and self.waiting.num_waiting(req.tenant) >= cap:
            raise QueueFull(f"tenant {req.tenant!r} has {cap} requests waiting, its cap",
                            self._retry_after())
        req.arrival_time = req.arrival_time or self.clock()
        self._refuse_overload(req)
        if self.block_manager is not None:  # hash the prompt now, not in a step
            self.block_manager.extend_hashes(req.token_ids, req.block_hashes,
                                             len(req.token_ids) // self.model.block_size)
        self.requests[req.request_id] = req
        self.waiting.push(req)

    def _refuse_overload(self, req: Request) -> None:
        """Raises QueueFull when ``req`` would wait past its tier's bound, by the
        throughput measured so far (core/admission.py). Also prunes idle tenants'
        fairness counters, amortized over Submits."""
        cfg, waiting = self.config, self.waiting
        # With anything waiting, free slots are not what holds it back (the KV pool
        # or the token budget is): a new request waits for departures like the rest.
        free = 0 if waiting else cfg.max_num_seqs - len(self.running)
        self._throughput.sample(req.arrival_time, self.num_finished,
                                bool(waiting) or free <= 0)
        tier = req.priority_tier
        bound = queue_time_bound(cfg, tier)
        rate = departure_rate(self._throughput.rate, self._service.rate(len(self.running)))
        refusal = overload_refusal(tier, bound, waiting.num_waiting_up_to(tier), free, rate)
        if refusal is None and bound > 0 and waiting:
            oldest = waiting.oldest_arrival_up_to(tier)
            waited = None if oldest is None else req.arrival_time - oldest
            refusal = head_of_line_refusal(tier, bound, waited)
        if refusal is not None:
            raise QueueFull(*refusal)
        if len(waiting.served) > 2 * (waiting.num_tenants + len(self._running_per_tenant)) + 64:
            waiting.prune(self._running_per_tenant)

    def _shed_overdue(self, now: float) -> None:
        """Ends queued requests that waited SHED_FACTOR x their tier's bound without
        starting, with a refusal and a retry hint (core/admission.py); at most every
        SHED_CHECK_S, when admission runs."""
        if not self.waiting or now < self._next_shed_check:
            return
        self._next_shed_check = now + SHED_CHECK_S
        cfg = self.config
        for req in self.waiting.overdue(now, lambda t: SHED_FACTOR * queue_time_bound(cfg, t)):
            self.waiting.remove(req)
            req.error, req.retry_after_s = shed_message(
                req.priority_tier, now - req.arrival_time, queue_time_bound(cfg, req.priority_tier))
            self._finish(req, FinishReason.ABORT)
            self._events.append((req, None, FinishReason.ABORT))
            self.num_shed += 1

    def _retry_after(self) -> float:
        # About one queue-turn: the queue drains max_num_seqs at a time.
        return min(30.0, 1.0 + len(self.waiting) / self.config.max_num_seqs)

    def admission_problem(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request can never be served by the current executor, or None."""
        if self.model is None:
            return None
        total = num_prompt_tokens + max_tokens
        if total > self.model.max_model_len:
            return (f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                    f"{total} exceeds the model's context of {self.model.max_model_len} tokens")
        bm = self.block_manager
        usable = bm.num_blocks - self._watermark_blocks()
        need = bm.blocks_needed(num_prompt_tokens)
        if need > usable:
            return (f"the prompt needs {need} KV blocks but the pool has {usable} usable; "
                    "shorten the prompt or give the executor more KV memory")
        return None

    def abort(self, request_id: str) -> Event | None:
        """Aborts a request; idempotent (None when unknown or already done)."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        if req.status == RequestStatus.RUNNING:
            self._remove_running(req)
        else:
            self.waiting.remove(req)
        self._finish(req, FinishReason.ABORT)
        return (req, None, FinishReason.ABORT)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._to_drop)

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
        out = SchedulerOutput(self._step_id)
        suspect = self._next_suspect() if self._suspects else None
        if suspect is not None and not self._unconfirmed and self._isolate(out, suspect):
            if out.new:
                out.num_batched_tokens = out.new[0][1]
        else:
            self._schedule_batch(out, admit=suspect is None)
        out.finished_seq_ids, self._to_drop = self._to_drop, []
        out.swap_out, self._swap_out = self._swap_out, []
        if not out.is_empty:  # an empty plan is never sent, so never answered
            self._unconfirmed.append(out)
            self._list_samplers(out)
        return out

    def _schedule_batch(self, out: SchedulerOutput, admit: bool) -> None:
        """Steps 2-5 of an iteration. ``admit`` False while a suspect waits for a step of
        its own: nobody overtakes it, and the running sequences drain the pool for it."""
        budget = self.config.max_num_batched_tokens
        num_running_at_start = len(self.running)
        preempts_before = self.num_preemptions
        budget, prefills = self._schedule_decodes(out, budget, ahead=bool(self._unconfirmed))
        budget = self._schedule_prefills(out, budget, prefills)
        if admit and self.num_preemptions == preempts_before and \
                self.policy.admission_open(num_running_at_start):
            budget = self._admit(out, budget, prefills)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget

    @staticmethod
    def _list_samplers(out: SchedulerOutput) -> None:
        """The answer's seq ids, in plan order, if every sample comes back (new sequences,
        then the cached ones: decodes all sample, a prefill chunk when it completes)."""
        ids = [r.seq_id for r, _ in out.new if r.num_computed_tokens >= len(r.token_ids)]
        out.num_new_samplers = len(ids)
        cached_ids = out.cached_seq_ids
        num_decodes = len(cached_ids) - len(out.cached_prefills)
        ids += cached_ids[:num_decodes]
        ids += [r.seq_id for r in out.cached_prefills
                if r.num_computed_tokens >= len(r.token_ids)]
        out.sampler_ids = ids

    def _schedule_decodes(self, out: SchedulerOutput, budget: int, ahead: bool):
        """Step 2: one token for every running decode. Returns (budget, partial prefills).

        ``ahead``: unanswered steps exist; a sequence whose sample is pending
        (``num_computed_tokens == len(token_ids)``) decodes the token to come,
        unless that token is certainly its last.

        The hottest path of the scheduler, so most decodes are not touched at all. A
        sequence that decodes one token a step is in *decode mode*: advancing the shared
        DecodeClock schedules all of them at once (their ids and token lists come from
        two dicts, in one order). A calendar keyed by clock epoch names the few that
        need a look this step: their token starts a block (it is appended, and the
        sequence moves to the end of the order so the plan's block deltas are the
        bulk's tail; with no block free it leaves decode mode, as it must to preempt),
        or their sample could be their last (they leave). Everything else — a new
        sequence, its first decode, a prefill chunk — goes through the explicit loop
        below, in priority order. (Decoded blocks are indexed when the sequence leaves
        the running set: ``_remove_running``.)
        """
        bm = self.block_manager
        bs = bm.block_size
        step = self._step_id
        clock = self._clock
        dm_ids, dm_tokens = self._dm_ids, self._dm_tokens
        starts: list[Request] = []
        start_blocks: list[int] = []
        leave_after: list[Request] = []  # decode this step, then leave decode mode
        due_starts: list[Request] = []
        epoch = clock.epoch
        if len(self._unconfirmed) > 1:
            # Two unanswered plans: a decode-mode sequence may have no pending token
            # left to decode, which only the explicit loop checks.
            self._leave_all_decode_mode()
        else:
            due = self._due.pop(epoch, None)
            if due:
                for req in dict.fromkeys(due):  # once each, in case it came back
                    if req._clock is not clock or req._due_epoch != epoch:
                        continue  # left decode mode since
                    if req._due_kind == _DUE_START:
                        due_starts.append(req)
                    else:
                        self._leave_decode_mode(req)
        running_status = RequestStatus.RUNNING
        prefills: list[Request] = []
        decodes: list[Request] = []
        append = decodes.append
        grew: list[tuple[int, list[int]]] = []  # (index in decodes, new block ids)
        explicit = self._explicit
        if due_starts or len(explicit) > 1:  # blocks go in priority order
            order = sorted(itertools.chain(explicit, due_starts), key=_order_key)
        else:
            order = list(explicit)
        preempts_before = self.num_preemptions
        for req in order:
            if req._clock is clock:  # in decode mode, and its token starts a block
                c = req._computed + epoch
                block = bm.try_append_block(req.seq_id, c + 1)
                if block != -2:
                    if block >= 0:
                        start_blocks.append(block)
                        starts.append(req)
                        del dm_ids[req], dm_tokens[req]  # to the end of the order
                        dm_ids[req] = req.seq_id
                        dm_tokens[req] = req.token_ids
                    if not self._plan_due(req, c + 1, epoch + 1, bs):
                        leave_after.append(req)
                    continue
                self._leave_decode_mode(req)  # it may have to preempt: one by one
            if req.status is not running_status:
                continue  # preempted earlier in this loop
            computed = req._computed
            pending = len(req.token_ids) - computed
            if pending != 1 and (pending or not ahead
                                 or computed + 1 >= req.length_limit):
                prefills.append(req)
                continue
            if computed % bs == 0:  # the token starts a new block
                block = bm.try_append_block(req.seq_id, computed + 1)
                if block >= 0:
                    grew.append((len(decodes), [block]))
                elif block == -2:
                    new = self._grow_decode(req, computed)
                    if new is None:
                        continue
                    if new:
                        grew.append((len(decodes), new))
            req._computed = computed + 1
            req._scheduled_step = step
            append(req)
        # Everything in decode mode decodes now: the clock advance is their
        # "num_computed_tokens += 1; scheduled_step = step".
        num_bulk = len(dm_ids)
        out.cached = list(dm_ids)
        out.cached.extend(decodes)
        out.cached_seq_ids = list(dm_ids.values())
        out.cached_seq_ids.extend(map(_seq_id, decodes))
        out.bulk_token_lists = list(dm_tokens.values())
        out.num_bulk = num_bulk
        if starts and self.num_preemptions != preempts_before:  # the bulk's tail: less
            start_blocks = [b for r, b in zip(starts, start_blocks, strict=True)  # victims
                            if r._clock is clock]
        clock.epoch += 1
        clock.step = step
        for req in leave_after:
            if req._clock is clock:
                self._leave_decode_mode(req)
        if bs >= _MIN_DECODE_MODE_BLOCK:
            for req in decodes:
                if req.status is running_status:
                    self._enter_decode_mode(req, bs)
        k = len(out.cached)
        self._charge_decodes(prefills)
        out.cached_num_tokens.extend([1] * k)
        nnew = [0] * k
        if start_blocks:
            nnew[num_bulk - len(start_blocks):num_bulk] = [1] * len(start_blocks)
            out.cached_new_block_ids.extend(start_blocks)
        for i, new in grew:
            nnew[num_bulk + i] = len(new)
            out.cached_new_block_ids.extend(new)
        out.cached_num_new_blocks.extend(nnew)
        return budget - k, prefills

    def _plan_due(self, req: Request, c: int, epoch: int, bs: int) -> bool:
        """Puts decode-mode ``req`` in the calendar: at the schedule of clock ``epoch``
        it will have computed ``c``; its next event is the first epoch whose token
        starts a block, or whose sample could be its last (then it leaves). False
        when that is a leave at ``epoch`` itself."""
        to_start = (-c) % bs
        to_limit = req.length_limit - 2 - c
        if to_limit <= to_start:
            j, kind = to_limit, _DUE_LEAVE
            if j <= 0:
                return False
        else:
            j, kind = to_start, _DUE_START
        epoch += j
        req._due_epoch = epoch
        req._due_kind = kind
        due = self._due.get(epoch)
        if due is None:
            self._due[epoch] = [req]
        else:
            due.append(req)
        return True

    def _enter_decode_mode(self, req: Request, bs: int) -> None:
        """After the clock advanced: ``req`` (explicit, just given a decode) rides the
        clock from now on, unless its next sample could already be its last."""
        clock = self._clock
        c = req._computed
        if not self._plan_due(req, c, clock.epoch, bs):
            return
        req._computed = c - clock.epoch
        req._clock = clock
        del self._explicit[req]
        self._dm_ids[req] = req.seq_id
        self._dm_tokens[req] = req.token_ids

    def _leave_decode_mode(self, req: Request) -> None:
        clock = req._clock
        req._computed += clock.epoch
        req._scheduled_step = clock.step
        req._clock = None
        del self._dm_ids[req]
        del self._dm_tokens[req]
        self._explicit[req] = None

    def _leave_all_decode_mode(self) -> None:
        for req in list(self._dm_ids):
            self._leave_decode_mode(req)
        self._due.clear()

    def _charge_decodes(self, prefills: list[Request]) -> None:
        """Fairness accounting: one token per running decode, per tenant in
        O(tenants) rather than a dict update per sequence (a decode that lost
        its turn to preemption this step is still charged: an approximation
        the virtual token counter tolerates)."""
        charge = self.waiting.charge
        for tenant, count in self._running_per_tenant.items():
            if count > 0:
                charge(tenant, count)
        for req in prefills:  # running but not decoding
            charge(req.tenant, -1)

    def _grow_decode(self, req: Request, computed: int) -> list[int] | None:
        """A block for a decode's next token (preempting if needed); None if it lost its turn."""
        bm = self.block_manager
        if not self._make_room(req, computed + 1):
            return None
        return bm.grow(req.seq_id, computed + 1)

    def _schedule_prefills(self, out: SchedulerOutput, budget: int,
                           prefills: list[Request]) -> int:
        """Step 3: running partial prefills continue, chunk-capped."""
        cap = self.policy.prefill_cap(self.config)
        for req in prefills:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue
            n = min(len(req.token_ids) - req.num_computed_tokens, budget, cap)
            if n <= 0 or not self._make_room(req, req.num_computed_tokens + n):
                continue
            new = self._advance(req, n)
            out.cached.append(req)
            out.cached_seq_ids.append(req.seq_id)
            out.cached_prefills.append(req)
            out.cached_num_tokens.append(n)
            out.cached_num_new_blocks.append(len(new))
            out.cached_new_block_ids.extend(new)
            out.num_prefill_tokens += n
            budget -= n
        return budget

    def _advance(self, req: Request, n: int) -> list[int]:
        bm = self.block_manager
        new = bm.grow(req.seq_id, req.num_computed_tokens + n)
        req.num_computed_tokens += n
        bm.register_full_blocks(req.seq_id, req.token_ids, req.block_hashes,
                                req.num_computed_tokens)
        req.scheduled_step = self._step_id
        self.waiting.charge(req.tenant, n)
        return new

    def _make_room(self, req: Request, num_tokens: int) -> bool:
        """Preempts until ``req`` can hold ``num_tokens`` positions; False if
        ``req`` itself was preempted (or cannot progress this step)."""
        bm = self.block_manager
        while not bm.can_grow(req.seq_id, num_tokens):
            victim = pick_victim(self.running, req, self._step_id)
            if victim is req:
                if len(self.running) == 1:
                    # Alone and the pool is full: the pool is its context limit.
                    self._remove_running(req)
                    self._finish(req, FinishReason.LENGTH)
                    self._events.append((req, None, FinishReason.LENGTH))
                else:
                    self._preempt(req, "kv_full")
                return False
            self._preempt(victim, "kv_full")
        return True

    def _admit(self, out: SchedulerOutput, budget: int, prefills: list[Request]) -> int:
        """Steps 4–5: resumed, then fresh requests, in the waiting queue's order."""
        bm = self.block_manager
        cap = self.policy.prefill_cap(self.config)
        # Kept free for the running: the watermark, and at least a block for each
        # running decode's next one (admitting into that block would preempt a stream
        # mid-answer at its next block boundary), plus the blocks the running prefills
        # will still take.
        reserve = max(self._watermark_blocks(), len(self.running) - len(prefills))
        reserve += sum(bm.num_new_blocks(r.seq_id, len(r.token_ids)) for r in prefills)
        now = self._now = self.clock()
        self._shed_overdue(now)
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek(now)
            if req is None:
                break
            if bm.blocks_needed(len(req.token_ids)) > bm.num_blocks:
                # Its context outgrew the pool while it ran (then it was preempted, or
                # the executor restarted): it can never resume in full, and nobody may
                # overtake it. The pool is its context limit, as for one running alone.
                self.waiting.remove(req)
                self._finish(req, FinishReason.LENGTH)
                self._events.append((req, None, FinishReason.LENGTH))
                continue
            # With nothing running the watermark protects no decode: a resumed context
            # that outgrew the pool minus the watermark comes back once the pool drains.
            keep = reserve if self.running else 0
            if req.status == RequestStatus.SWAPPED:
                n = self._swap_in(req, out, budget, cap, keep)
            else:
                n = self._start(req, out, budget, cap, keep)
            if n == 0:
                break  # the best request does not fit yet; nobody overtakes it
            budget -= n
        return budget

    def _start(self, req: Request, out: SchedulerOutput, budget: int, cap: int,
               reserve: int) -> int:
        """Admits a fresh or recompute-preempted request; returns tokens scheduled."""
        bm = self.block_manager
        hits, _ = bm.num_cached_prefix(req.token_ids, req.block_hashes)
        num_tokens = len(req.token_ids)
        resumed = req.num_preemptions > 0
        # Cached-free hits leave the free pool when shared.
        need = bm.blocks_needed(num_tokens) - len(hits) + bm.num_unreferenced(hits)
        if need + reserve > bm.num_free_blocks:
            return 0
        self.waiting.remove(req)
        bm.share_prefix(req.seq_id, hits)
        req.num_computed_tokens = len(hits) * bm.block_size
        if resumed:  # never resume partially: its whole context, or keep waiting
            bm.grow(req.seq_id, num_tokens)
        n = min(num_tokens - req.num_computed_tokens, budget, cap)
        self._make_running(req)
        self._advance(req, n)
        out.new.append((req, n))
        out.num_prefill_tokens += n
        return n

    def _swap_in(self, req: Request, out: SchedulerOutput, budget: int, cap: int,
                 reserve: int) -> int:
        bm = self.block_manager
        remaining = len(req.token_ids) - req.num_computed_tokens
        extra = bm.blocks_needed(len(req.token_ids)) - len(bm.host_table(req.seq_id))
        if not bm.can_swap_in(req.seq_id, reserve + max(0, extra)):
            return 0
        self.waiting.remove(req)
        out.swap_in.extend(bm.swap_in(req.seq_id))
        bm.grow(req.seq_id, len(req.token_ids))  # whole context, as for any resume
        n = min(remaining, budget, cap)
        self._make_running(req)
        self._advance(req, n)
        out.new.append((req, n))
        return n

    def _make_running(self, req: Request) -> None:
        assert self.model is not None
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self.clock()
            req.prepare(self.model.eos_token_ids, self.model.max_model_len)
        # Requests share one object per distinct stop set (fewer cache lines per step),
        # and every running one's is in _stop_union (update's stop-token filter).
        interned = self._stop_sets.get(req.stop_ids)
        if interned is None:
            if len(self._stop_sets) > 1024:
                self._stop_sets.clear()
                self._stop_union = frozenset().union(*(r.stop_ids for r in self.running))
            interned = self._stop_sets[req.stop_ids] = req.stop_ids
            self._stop_union |= interned
        req.stop_ids = interned
        self._admit_seq += 1
        req.admit_seq = self._admit_seq
        req.status = RequestStatus.RUNNING
        tier, admitted = priority_key(req)
        key = req._order_key = (tier << 48) | admitted
        i = bisect.bisect(self._running_keys, key)
        self._running_keys.insert(i, key)
        self.running.insert(i, req)
        self._by_seq[req.seq_id] = req
        self._explicit[req] = None
        self._running_per_tenant[req.tenant] += 1

    def _watermark_blocks(self) -> int:
        return int(self.config.watermark * self.block_manager.num_blocks)

    # -- results -----------------------------------------------------------------------

    def update(self, out: SchedulerOutput, seq_ids: Sequence[int],
               token_ids: Sequence[int]) -> list[Event]:
        """Folds one step's sampled tokens in; returns what clients must hear."""
        events, self._events = self._events, []
        confirmed = self._unconfirmed
        was_open = any(unanswered is out for unanswered in confirmed)  # not voided
        while confirmed and confirmed[0].step_id <= out.step_id:
            confirmed.popleft()
        if out.isolated is not None and was_open:  # its step of its own succeeded
            self._solo_step_done(out.isolated)
        # Plain lists first: iterating protobuf repeated fields costs twice as much.
        seq_ids, token_ids = list(seq_ids), list(token_ids)
        if was_open and seq_ids == out.sampler_ids:
            self.num_columnar_updates += 1
            a = out.num_new_samplers
            b = a + out.num_bulk
            if a:
                self._apply_samples(seq_ids[:a], token_ids[:a], events)
            if b > a:
                self._apply_bulk(out, token_ids[a:b], events)
            self._apply_samples(seq_ids[b:], token_ids[b:], events)
        else:
            # A sample is missing or unasked for: decode mode assumes each of its
            # sequences got the one it was planned, so they go back to explicit steps.
            self.num_update_fallbacks += 1
            self._leave_all_decode_mode()
            self._apply_samples(seq_ids, token_ids, events)
        if self._awaiting:
            self._apply_awaiting(out.step_id, seq_ids, token_ids, events)
        return events

    def _apply_samples(self, seq_ids: list[int], token_ids: list[int],
                       events: list[Event]) -> None:
        """Samples one by one, with every check (the answer's non-bulk part)."""
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
                    self._remove_running(req)
                    self._finish(req, reason)
                append((req, token, reason))
            else:
                append((req, token, None))

    def _apply_bulk(self, out: SchedulerOutput, token_ids: list[int],
                    events: list[Event]) -> None:
        """Samples of the plan's decode-mode sequences, columnar. Each is still running
        unless listed in ``out.removed``, its sample is the one planned, and it is not
        its last by length (decode mode ends before that), so only a stop token needs
        a look at the sequence itself."""
        n = out.num_bulk
        cuts: list[int] = []
        if out.removed:
            ids = out.cached_seq_ids
            for seq_id in out.removed:
                try:
                    cuts.append(ids.index(seq_id, 0, n))
                except ValueError:
                    pass
            cuts.sort()
        lo = 0
        for cut in cuts:
            self._apply_bulk_run(out, token_ids, lo, cut, events)
            self._apply_samples([out.cached_seq_ids[cut]], [token_ids[cut]], events)
            lo = cut + 1
        self._apply_bulk_run(out, token_ids, lo, n, events)

    def _apply_bulk_run(self, out: SchedulerOutput, token_ids: list[int], lo: int, hi: int,
                        events: list[Event]) -> None:
        if lo >= hi:
            return
        tokens = token_ids[lo:hi]
        reqs = out.cached[lo:hi]
        for history, token in zip(out.bulk_token_lists[lo:hi], tokens, strict=True):
            history.append(token)
        base = len(events)
        events.extend(zip(reqs, tokens, itertools.repeat(None)))
        stop = self._stop_union
        if stop.isdisjoint(tokens):
            return
        for i in itertools.compress(range(hi - lo), map(stop.__contains__, tokens)):
            req, token = reqs[i], tokens[i]
            if token in req.stop_ids:
                reason = req.finish_reason_for(token)
                if reason is not None:
                    self._remove_running(req)
                    self._finish(req, reason)
                    events[base + i] = (req, token, reason)

    def _apply_awaiting(self, step_id: int, seq_ids: list[int], token_ids: list[int],
                        events: list[Event]) -> None:
        """Samples of step ``step_id`` for sequences preempted after it was sent."""
        awaiting = self._awaiting
        for seq_id, token in zip(seq_ids, token_ids, strict=True):
            req = awaiting.get(seq_id)
            if req is None or req.scheduled_step != step_id or req.is_finished:
                continue
            del awaiting[seq_id]
            req.token_ids.append(token)
            reason = req.finish_reason_for(token)
            if reason is not None:
                self.waiting.remove(req)
                self._finish(req, reason)
            events.append((req, token, reason))
        for seq_id, req in list(awaiting.items()):
            if req.scheduled_step <= step_id:  # its sample was lost with the step
                del awaiting[seq_id]

    def take_events(self) -> list[Event]:
        """Events produced outside ``update`` (e.g. a request finished by schedule)."""
        events, self._events = self._events, []
        return events

    # -- transitions -------------------------------------------------------------------

    def _preempt(self, req: Request, reason: str, allow_swap: bool = True,
                 index: bool = True) -> None:
        """Swap (if cheaper and the host pool has room) or recompute. ``index``: False
        when the cache is about to be forgotten (resync, a new executor)."""
        bm = self.block_manager
        self._remove_running(req, index)
        self._to_drop.append(req.seq_id)  # the executor drops its state either way
        if self._unconfirmed and req.num_computed_tokens == len(req.token_ids):
            self._awaiting[req.seq_id] = req  # its sample from an unanswered step counts
        swap = (allow_swap and bm.can_swap_out(req.seq_id) and self.model.cost.prefers_swap(
            req.num_computed_tokens, len(bm.block_table(req.seq_id))))
        if swap:
            self._swap_out.extend(bm.swap_out(req.seq_id))
            req.status = RequestStatus.SWAPPED
        else:
            bm.free(req.seq_id)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
        now = self.clock()
        req.num_preemptions += 1
        window = self.config.preemption_window_s
        req.preempt_times = [t for t in req.preempt_times if now - t < window] + [now]
        if len(req.preempt_times) >= self.config.max_preemptions:
            req.protected = True
        self.num_preemptions += 1
        self.preemptions_by_reason[f"{reason}:{'swap' if swap else 'recompute'}"] += 1
        self.waiting.push(req, front=True)

    def _remove_running(self, req: Request, index: bool = True) -> None:
        """``index``: its full blocks go into the prefix cache first. Decoded blocks
        are indexed here, once per sequence, not as each fills (one call instead of
        one per block; while it runs no other sequence has its output anyway)."""
        if req._clock is not None:
            self._leave_decode_mode(req)
        if index:
            self.block_manager.register_full_blocks(
                req.seq_id, req.token_ids, req.block_hashes, req._computed)
        i = bisect.bisect_left(self._running_keys, req._order_key)
        assert self.running[i] is req
        del self.running[i]
        del self._running_keys[i]
        del self._by_seq[req.seq_id]
        del self._explicit[req]
        left = self._running_per_tenant[req.tenant] - 1
        if left:
            self._running_per_tenant[req.tenant] = left
        else:  # no zero entries: unique tenant names must not grow the per-step loop
            del self._running_per_tenant[req.tenant]
        for out in self._unconfirmed:  # its samples there need the full checks
            out.removed.add(req.seq_id)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if self.block_manager is not None:
            if req.status == RequestStatus.RUNNING:
                self._to_drop.append(req.seq_id)
            self.block_manager.free(req.seq_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if reason <= FinishReason.LENGTH and req.first_scheduled_time is not None:
            self._service.add(self._now - req.first_scheduled_time, len(self.running) + 1)
        del self.requests[req.request_id]
        if self._suspects:
            self._suspects.pop(req, None)
        self.num_finished += 1

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
        assert self._running_keys == sorted(self._running_keys)
        assert set(self._by_seq.values()) == set(self.running)
        assert self._dm_ids.keys() == self._dm_tokens.keys()
        assert not (self._dm_ids.keys() & self._explicit.keys())
        assert self._dm_ids.keys() | self._explicit.keys() == set(self.running)
        for req, seq_id in self._dm_ids.items():
            assert req._clock is self._clock and seq_id == req.seq_id
            assert self._dm_tokens[req] is req.token_ids
            assert req._due_epoch >= self._clock.epoch, "its event is past"
            assert req in self._due.get(req._due_epoch, ()), "no event planned"
        ahead = 1 if self._unconfirmed else 0  # a decode of a pending sample
        for req in self.running:
            assert req.status == RequestStatus.RUNNING
            assert 0 <= req.num_computed_tokens <= len(req.token_ids) + ahead
        for req in self.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.SWAPPED)
            assert req.status == RequestStatus.SWAPPED or req.num_computed_tokens == 0
        assert len(self.requests) == len(self.running) + len(self.waiting)
