"""Transitions: a request moves between the waiting queue, the running set and its end.

The Lifecycle owns where each request is and the executor it runs on (``model``,
``block_manager``; None while detached), so each transition keeps all of them in step and
records what the next plan must tell the executor (``take_owed``: sequences to drop,
blocks to swap out). Who leaves the queue in a step is the scheduler's admission stage.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from scheduler_svc.core import preemption
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.decodes import Decodes
from scheduler_svc.core.kv_events import KVEventLog
from scheduler_svc.core.plan import ModelInfo, StepRecord
from scheduler_svc.core.queue import WaitingQueue
from scheduler_svc.core.request import FINISHED, RUNNING, FinishReason, Request, RequestStatus
from scheduler_svc.core.results import Unanswered
from scheduler_svc.core.running import RunningSet


class Lifecycle:
    """Owns the places a request can be (``waiting``, ``running_set``, ``decodes``,
    ``requests``: every live one by id), the current executor (``model``,
    ``block_manager``), what the next plan owes the executor (drops, swap-outs), and the
    transition counters. ``unanswered`` is told of sequences that leave the running set
    while plans are out; ``on_served`` of each request served to its end."""

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float],
                 unanswered: Unanswered) -> None:
        self.config = config
        self.clock = clock
        self.waiting = WaitingQueue(config.aging_s)
        self.running_set = RunningSet()
        self.decodes = Decodes()
        self._unanswered = unanswered
        self.on_served: Callable[[Request], None] = _ignore
        self.block_manager: BlockManager | None = None
        self.model: ModelInfo | None = None
        self._hashed_block_size = 0  # the block size of every request's block_hashes
        self.requests: dict[str, Request] = {}
        self._to_drop: list[int] = []
        self._swap_out: list[tuple[int, int]] = []  # device, host
        self.num_swap_cap_fallbacks = 0  # recomputed, not swapped, for max_swapped
        self.num_finished = 0
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # computed KV dropped, to be computed again
        self.preemptions_by_reason: collections.Counter[str] = collections.Counter()

    # -- the executor ------------------------------------------------------------------

    def attach(self, model: ModelInfo, kv_events: KVEventLog | None) -> None:
        """A new executor incarnation: its KV cache is empty, so every running or swapped
        sequence goes back to the queue to be recomputed."""
        self.reset_kv()
        if model.block_size != self._hashed_block_size:  # block hashes depend on it
            for req in self.requests.values():
                req.block_hashes.clear()
                req.block_chunks.clear()
            self._hashed_block_size = model.block_size
        cfg = self.config
        self.model = model
        self.block_manager = BlockManager(
            model.num_blocks, model.block_size, model.num_host_blocks,
            cfg.enable_prefix_caching, kv_events, model.kv_window, cfg.max_num_batched_tokens)

    def detach(self, kv_events: KVEventLog | None) -> None:
        """The executor is gone: nothing runs until ``attach``."""
        self.reset_kv()
        if kv_events is not None:  # its cache went with it
            kv_events.cleared()
        self.model = None
        self.block_manager = None

    def reset_kv(self) -> None:
        """The executor's KV and state are gone: every sequence is recomputed and no plan
        built so far will be answered."""
        self.recompute_all("executor_restart", free_swapped=False)
        self._to_drop.clear()
        self._unanswered.forget()
        self._swap_out.clear()

    def resync(self) -> None:
        """The executor refused a plan: it holds nothing, every running sequence is
        recomputed from its token history (see Scheduler.resync)."""
        self._to_drop.extend(self._unanswered.drop_lists())
        self._unanswered.forget()
        self.recompute_all("resync", free_swapped=True)
        self.block_manager.forget_cached()

    @property
    def owes_drops(self) -> bool:
        """The next plan has sequences to tell the executor to drop."""
        return bool(self._to_drop)

    def take_owed(self) -> tuple[list[int], list[tuple[int, int]]]:
        """What the plan being built must tell the executor: the sequences to drop and
        the blocks to swap out, since the last plan."""
        owed = self._to_drop, self._swap_out
        self._to_drop, self._swap_out = [], []
        return owed

    # -- transitions -------------------------------------------------------------------

    def enqueue(self, req: Request) -> None:
        """``req`` (admitted at Submit) is live and waits."""
        self.requests[req.request_id] = req
        self.waiting.push(req)

    def make_running(self, req: Request) -> None:
        """``req`` (out of the waiting queue, its blocks allocated) starts running."""
        model = self.model
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self.clock()
            req.prepare(model.eos_token_ids, model.max_model_len)
        req.status = RUNNING
        self.running_set.add(req)
        self.decodes.add(req)

    def start(self, req: Request, rec: StepRecord, budget: int, cap: int, reserve: int,
              step: int) -> tuple[int, int]:
        """Admits a fresh or recompute-preempted request into step ``step`` (``rec``),
        leaving ``reserve`` blocks free; returns (tokens scheduled, 0) or, when it does
        not fit, (0, the device blocks it needs)."""
        bm = self.block_manager
        hits, _ = bm.num_cached_prefix(req.token_ids, req.block_hashes, req.block_chunks)
        num_tokens = len(req.token_ids)
        resumed = req.num_preemptions > 0
        computed = len(hits) * bm.block_size
        n = min(num_tokens - computed, budget, cap)
        # Cached-free hits leave the free pool when shared. Under a window the first grow
        # gives back at once the hits behind its first query's window (a long cached
        # prefix), so only the rest count, and its first step's blocks are asked for.
        live = hits[max(0, (computed - bm.window) // bm.block_size):] if bm.window else hits
        step_blocks = -(-(computed + n) // bm.block_size) - len(hits)
        need = max(0, bm.blocks_needed(num_tokens) - len(live), step_blocks) + \
            bm.num_unreferenced(live)
        if need + reserve > bm.num_free_blocks:
            return 0, need
        self.waiting.remove(req)
        bm.share_prefix(req.seq_id, hits)
        req.num_computed_tokens = computed
        if resumed and not bm.window:  # never resume partially: its whole context, or
            bm.grow(req.seq_id, num_tokens)  # keep waiting (under a window: its window's)
        self.make_running(req)
        self.advance(req, n, step)
        rec.add_new(req, n)
        rec.num_prefill_tokens += n
        return n, 0

    def swap_in(self, req: Request, rec: StepRecord, budget: int, cap: int, reserve: int,
                step: int) -> tuple[int, int]:
        """Resumes a swapped request (its whole context), as ``start`` does."""
        bm = self.block_manager
        remaining = len(req.token_ids) - req.num_computed_tokens
        # The blocks grow() takes after the swap: the table comes back with its released
        # entries (under a window) and its swapped blocks, and nothing is released then.
        extra = -(-len(req.token_ids) // bm.block_size) - bm.num_released(req.seq_id) - len(
            bm.host_table(req.seq_id))
        if not bm.can_swap_in(req.seq_id, reserve + max(0, extra)):
            return 0, len(bm.host_table(req.seq_id)) + max(0, extra)
        self.waiting.remove(req)
        swapped = bm.swap_in(req.seq_id)
        bm.grow(req.seq_id, len(req.token_ids))  # whole context, as for any resume
        n = min(remaining, budget, cap)
        self.make_running(req)
        self.advance(req, n, step)
        rec.add_new(req, n, swapped)
        return n, 0

    def advance(self, req: Request, n: int, step: int) -> list[int]:
        """``req`` computes ``n`` more tokens in ``step`` (docs/design.md §2): its blocks grow,
        its full ones enter the prefix cache, its tenant is charged. Returns new blocks."""
        bm = self.block_manager
        new = bm.grow(req.seq_id, req.num_computed_tokens + n, n)
        computed = req.num_computed_tokens = req.num_computed_tokens + n
        bm.register_full_blocks(req.seq_id, req.token_ids, req.block_hashes,
                                computed, req.block_chunks)
        req.scheduled_step = step
        self.waiting.charge(req.tenant, n)
        return new

    def make_room(self, req: Request, num_tokens: int, rec: StepRecord,
                  victim_key: Callable[[Request], tuple]) -> bool:
        """Preempts, in the policy's victim order (``victim_key``), until ``req`` can hold
        ``num_tokens`` positions in step ``rec``; False if ``req`` itself was preempted,
        or ended because alone it outgrew the pool (``rec.ended`` says so)."""
        bm = self.block_manager
        running = self.running_set.order
        while not bm.can_grow(req.seq_id, num_tokens, 0, num_tokens - req.num_computed_tokens):
            victim = preemption.pick_victim(running, req, rec.step_id, victim_key)
            if victim is req:
                if len(running) == 1:
                    # Alone and the pool is full: the pool is its context limit.
                    self.end_running(req, FinishReason.LENGTH)
                    rec.end(req, FinishReason.LENGTH)
                else:
                    self.preempt(req, "kv_full")
                return False
            self.preempt(victim, "kv_full")
        return True

    def recompute_all(self, reason: str, free_swapped: bool) -> None:
        """The executor's KV is gone or void: every running sequence is preempted to be
        recomputed, and every swapped one goes back to waiting as well (its host blocks
        freed when ``free_swapped``: the same pool lives on)."""
        for req in list(reversed(self.running_set.order)):
            self.preempt(req, reason, allow_swap=False, index=False)
        for req in list(self.waiting):
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
        self._to_drop.append(req.seq_id)  # the executor drops its state either way
        self._unanswered.preempted(req)
        swap = (allow_swap and bm.can_swap_out(req.seq_id) and self.model.cost.prefers_swap(
            req.num_computed_tokens, len(bm.block_table(req.seq_id))))
        if swap and 0 < self.config.max_swapped <= bm.num_swapped:
            swap = False  # host-pool pressure (SchedulerConfig.max_swapped): recompute
            self.num_swap_cap_fallbacks += 1
        if swap:
            self._swap_out.extend(bm.swap_out(req.seq_id))
            req.status = RequestStatus.SWAPPED
            req.num_swaps += 1
        else:
            bm.free(req.seq_id)
            self.num_recomputed_tokens += req.num_computed_tokens
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

    def remove_running(self, req: Request, index: bool = True) -> None:
        """``index``: its full blocks go into the prefix cache first. Decoded blocks
        are indexed here, once per sequence, not as each fills (one call instead of
        one per block; while it runs no other sequence has its output anyway)."""
        self.decodes.remove(req)
        if index:
            self.block_manager.register_full_blocks(
                req.seq_id, req.token_ids, req.block_hashes, req.num_computed_tokens,
                req.block_chunks)
        self.running_set.remove(req)
        self._unanswered.left_running(req)  # its samples there need the full checks

    def end_running(self, req: Request, reason: FinishReason) -> None:
        self.remove_running(req)
        self.finish(req, reason)

    def end_waiting(self, req: Request, reason: FinishReason) -> None:
        self.waiting.remove(req)
        self.finish(req, reason)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """``req`` (out of the running set or the queue) ends with ``reason``."""
        if self.block_manager is not None:
            if req.status == RUNNING:
                self._to_drop.append(req.seq_id)
            self.block_manager.free(req.seq_id)
        req.status = FINISHED
        req.finish_reason = reason
        if reason <= FinishReason.LENGTH:
            self.on_served(req)
        del self.requests[req.request_id]
        self.num_finished += 1


def _ignore(req: Request) -> None:
    pass
