"""Transitions: a request moves between the waiting queue, the running set and its end.

Steps 4–5 of an iteration (``admit``: who leaves the queue for the running set) are
here too, beside the transitions they make (``start``, ``swap_in``).

Each transition keeps every collaborator that holds the request in step (the running
set, decode mode, the waiting queue, the block pool, the prefix cache) and records what
the executor must hear of it in the next plan: the sequences whose state it must drop
(finished, aborted, preempted) and the blocks to swap out.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from scheduler_svc.core.admission import Admission
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.decode_mode import DecodeMode
from scheduler_svc.core.plan import Event, ModelInfo, StepRecord
from scheduler_svc.core.queue import WaitingQueue
from scheduler_svc.core.request import FinishReason, Request, RequestStatus
from scheduler_svc.core.results import ResultApplier
from scheduler_svc.core.running import RunningSet


class Lifecycle:
    """Owns the registry of live requests (``requests``), the executor's drop list and
    swap-outs for the next plan, and the transition counters. ``block_manager`` and
    ``model`` are the current executor's (None while there is none); ``results`` is
    wired after construction (it ends requests through ``end_running`` and
    ``end_waiting``)."""

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float],
                 waiting: WaitingQueue, running: RunningSet, decode_mode: DecodeMode,
                 admission: Admission, suspects: dict[Request, None],
                 unconfirmed: collections.deque[StepRecord]) -> None:
        self.config = config
        self._clock = clock
        self._waiting = waiting
        self._running = running
        self._decode_mode = decode_mode
        self._admission = admission
        self._suspects = suspects  # core/isolation.py's: an ended request leaves it
        self._unconfirmed = unconfirmed  # the scheduler's unanswered steps
        self.results: ResultApplier | None = None
        self.block_manager: BlockManager | None = None
        self.model: ModelInfo | None = None
        self.requests: dict[str, Request] = {}
        self.to_drop: list[int] = []
        self.swap_out: list[tuple[int, int]] = []  # device, host
        # The waiting queue's best request found no room (a slot or KV) in the last
        # admission, or a better tier than the worst running arrived since, and the
        # blocks admission kept free then: core/priority_hold.py's trigger and estimate.
        self.wants_room = False
        self.reserve = 0
        self.blocked: Request | None = None  # the request that did not fit, and its
        self.blocked_need = 0  # device blocks (None, 0: the slots were short)
        self.held_back: set[Request] = set()  # preempted for priority in this step
        self.num_swap_cap_fallbacks = 0  # recomputed, not swapped, for max_swapped
        self.num_finished = 0
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # computed KV dropped, to be computed again
        self.preemptions_by_reason: collections.Counter[str] = collections.Counter()

    def make_running(self, req: Request) -> None:
        """``req`` (out of the waiting queue, its blocks allocated) starts running."""
        model = self.model
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self._clock()
            req.prepare(model.eos_token_ids, model.max_model_len)
        self.results.intern_stops(req)
        req.status = RequestStatus.RUNNING
        self._running.add(req)
        self._decode_mode.add(req)

    def admit(self, rec: StepRecord, budget: int, cap: int, prefills: list[Request],
              step: int, events: list[Event]) -> int:
        """Steps 4–5 of an iteration: resumed, then fresh requests, in the waiting
        queue's order, into step ``step`` (``rec``); ``prefills`` are the running ones
        still prefilling. Returns the budget left; ends go to ``events``."""
        bm = self.block_manager
        running = self._running.order
        # Kept free for the running: the watermark, and at least a block for each
        # running decode's next one (admitting into that block would preempt a stream
        # mid-answer at its next block boundary), plus the blocks the running prefills
        # will still take.
        reserve = max(self._admission.watermark_blocks(bm), len(running) - len(prefills))
        reserve += sum(bm.num_new_blocks(r.seq_id, len(r.token_ids)) for r in prefills)
        self.reserve, self.blocked = reserve, None
        now = self._admission.now = self._clock()
        shed = self._admission.rejudge()  # blind admissions an estimate now refuses
        shed += [r for r in self._admission.overdue(now) if r not in shed]  # twice late
        for req in shed:
            self.end_waiting(req, FinishReason.ABORT)
            events.append(Event(req, None, FinishReason.ABORT))
        while budget > 0 and len(running) < self.config.max_num_seqs:
            req = self._waiting.peek(now)
            if req is None or req in self.held_back:
                # Preempted this step to make room for a better tier: resuming it at
                # once would undo that (and, its sample still pending when scheduling
                # ahead, sample that position twice).
                break
            if bm.blocks_needed(len(req.token_ids)) > bm.num_blocks:
                # Its context outgrew the pool while it ran (then it was preempted, or
                # the executor restarted): it can never resume in full, and nobody may
                # overtake it. The pool is its context limit, as for one running alone.
                self.end_waiting(req, FinishReason.LENGTH)
                events.append(Event(req, None, FinishReason.LENGTH))
                continue
            # With nothing running the watermark protects no decode: a resumed context
            # that outgrew the pool minus the watermark comes back once the pool drains.
            keep = reserve if running else 0
            if req.status == RequestStatus.SWAPPED:
                n = self.swap_in(req, rec, budget, cap, keep, step)
            else:
                n = self.start(req, rec, budget, cap, keep, step)
            if n == 0:
                self.blocked = req
                break  # the best request does not fit yet; nobody overtakes it
            budget -= n
        # Anything left waiting waits for room or for prefill throughput (a budget
        # spent on long prompts holds the queue as surely as a full pool): see Admission.
        self._admission.blocked = bool(self._waiting)
        self.wants_room = self._admission.blocked and budget > 0  # room, not the budget
        return budget

    def start(self, req: Request, rec: StepRecord, budget: int, cap: int, reserve: int,
              step: int) -> int:
        """Admits a fresh or recompute-preempted request into step ``step`` (``rec``),
        leaving ``reserve`` blocks free; returns tokens scheduled (0: it does not fit)."""
        bm = self.block_manager
        hits, _ = bm.num_cached_prefix(req.token_ids, req.block_hashes)
        num_tokens = len(req.token_ids)
        resumed = req.num_preemptions > 0
        # Cached-free hits leave the free pool when shared.
        need = max(0, bm.blocks_needed(num_tokens) - len(hits)) + bm.num_unreferenced(hits)
        if need + reserve > bm.num_free_blocks:
            self.blocked_need = need
            return 0
        self._waiting.remove(req)
        bm.share_prefix(req.seq_id, hits)
        req.num_computed_tokens = len(hits) * bm.block_size
        if resumed and not bm.window:  # never resume partially: its whole context, or
            bm.grow(req.seq_id, num_tokens)  # keep waiting (under a window: its window's)
        n = min(num_tokens - req.num_computed_tokens, budget, cap)
        self.make_running(req)
        self.advance(req, n, step)
        rec.new.append((req, n))
        rec.num_prefill_tokens += n
        return n

    def swap_in(self, req: Request, rec: StepRecord, budget: int, cap: int, reserve: int,
                step: int) -> int:
        """Resumes a swapped request (its whole context), as ``start`` does."""
        bm = self.block_manager
        remaining = len(req.token_ids) - req.num_computed_tokens
        extra = bm.blocks_needed(len(req.token_ids)) - len(bm.host_table(req.seq_id))
        if not bm.can_swap_in(req.seq_id, reserve + max(0, extra)):
            self.blocked_need = len(bm.host_table(req.seq_id)) + max(0, extra)
            return 0
        self._waiting.remove(req)
        rec.swap_in.extend(bm.swap_in(req.seq_id))
        bm.grow(req.seq_id, len(req.token_ids))  # whole context, as for any resume
        n = min(remaining, budget, cap)
        self.make_running(req)
        self.advance(req, n, step)
        rec.new.append((req, n))
        return n

    def advance(self, req: Request, n: int, step: int) -> list[int]:
        """``req`` computes ``n`` more tokens in ``step`` (docs/design.md §2): its blocks grow,
        its full ones enter the prefix cache, its tenant is charged. Returns new blocks."""
        bm = self.block_manager
        new = bm.grow(req.seq_id, req.num_computed_tokens + n, n)
        req.num_computed_tokens += n
        bm.register_full_blocks(req.seq_id, req.token_ids, req.block_hashes,
                                req.num_computed_tokens)
        req.scheduled_step = step
        self._waiting.charge(req.tenant, n)
        return new

    def recompute_all(self, reason: str, free_swapped: bool) -> None:
        """The executor's KV is gone or void: every running sequence is preempted to be
        recomputed, and every swapped one goes back to waiting as well (its host blocks
        freed when ``free_swapped``: the same pool lives on)."""
        for req in list(reversed(self._running.order)):
            self.preempt(req, reason, allow_swap=False, index=False)
        for req in list(self._waiting):
            if req.status == RequestStatus.SWAPPED:
                if free_swapped:
                    self.block_manager.free(req.seq_id)
                self.num_recomputed_tokens += req.num_computed_tokens
                req.status, req.num_computed_tokens = RequestStatus.WAITING, 0

    def preempt(self, req: Request, reason: str, allow_swap: bool = True,
                index: bool = True) -> None:
        """Swap (if cheaper and the host pool has room) or recompute. ``index``: False
        when the cache is about to be forgotten (resync, a new executor)."""
        bm = self.block_manager
        self.remove_running(req, index)
        self.to_drop.append(req.seq_id)  # the executor drops its state either way
        if self._unconfirmed and req.num_computed_tokens == len(req.token_ids):
            self.results.awaiting[req.seq_id] = req  # its pending sample still counts
        swap = (allow_swap and bm.can_swap_out(req.seq_id) and self.model.cost.prefers_swap(
            req.num_computed_tokens, len(bm.block_table(req.seq_id))))
        if swap and 0 < self.config.max_swapped <= bm.num_swapped:
            swap = False  # host-pool pressure (SchedulerConfig.max_swapped): recompute
            self.num_swap_cap_fallbacks += 1
        if swap:
            self.swap_out.extend(bm.swap_out(req.seq_id))
            req.status = RequestStatus.SWAPPED
            req.num_swaps += 1
        else:
            bm.free(req.seq_id)
            self.num_recomputed_tokens += req.num_computed_tokens
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
        now = self._clock()
        req.num_preemptions += 1
        window = self.config.preemption_window_s
        req.preempt_times = [t for t in req.preempt_times if now - t < window] + [now]
        if len(req.preempt_times) >= self.config.max_preemptions:
            req.protected = True
        self.num_preemptions += 1
        self.preemptions_by_reason[f"{reason}:{'swap' if swap else 'recompute'}"] += 1
        self._waiting.push(req, front=True)

    def remove_running(self, req: Request, index: bool = True) -> None:
        """``index``: its full blocks go into the prefix cache first. Decoded blocks
        are indexed here, once per sequence, not as each fills (one call instead of
        one per block; while it runs no other sequence has its output anyway)."""
        self._decode_mode.remove(req)
        if index:
            self.block_manager.register_full_blocks(
                req.seq_id, req.token_ids, req.block_hashes, req.num_computed_tokens)
        self._running.remove(req)
        for rec in self._unconfirmed:  # its samples there need the full checks
            rec.removed.add(req.seq_id)

    def end_running(self, req: Request, reason: FinishReason) -> None:
        self.remove_running(req)
        self.finish(req, reason)

    def end_waiting(self, req: Request, reason: FinishReason) -> None:
        self._waiting.remove(req)
        self.finish(req, reason)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """``req`` (out of the running set or the queue) ends with ``reason``."""
        if self.block_manager is not None:
            if req.status == RequestStatus.RUNNING:
                self.to_drop.append(req.seq_id)
            self.block_manager.free(req.seq_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if reason <= FinishReason.LENGTH:
            self._admission.finished(req)
        del self.requests[req.request_id]
        if self._suspects:
            self._suspects.pop(req, None)
        self.num_finished += 1
