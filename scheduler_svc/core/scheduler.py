"""The iteration scheduler: one call to ``schedule()`` is one batch plan.

Order of one iteration (DESIGN.md §3): running decodes first, then running
partial prefills (chunked), then admission of waiting requests (FCFS here;
priorities and tenant fairness arrive with the scheduler-core issue), all
within ``max_num_batched_tokens`` and ``max_num_seqs``. A decode that cannot
get a KV slot preempts the most recently admitted sequence that has not been
scheduled yet (recompute), or itself when there is none.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterable

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.request import FinishReason, Request, RequestStatus


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the scheduler needs to know about the executor it plans for."""

    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]


@dataclasses.dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step."""

    request: Request
    num_tokens: int  # tokens computed this step, from num_computed_tokens before the step
    new_block_ids: list[int]
    is_new: bool  # the executor holds no state for it: send it in full
    samples: bool  # this step brings num_computed_tokens up to num_tokens


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    step_id: int
    scheduled: tuple[ScheduledSeq, ...]
    # Sequences the executor must drop before running this step.
    finished_seq_ids: tuple[int, ...]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.finished_seq_ids


@dataclasses.dataclass(slots=True)
class RequestEvent:
    """Something a client must hear: new tokens and/or the end of its stream."""

    request: Request
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None


class Scheduler:
    """Owns every request's state and the block pool of the current executor.

    Not thread-safe by design: one loop owns it and calls it between steps.
    """

    def __init__(
        self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.clock = clock
        self.model: ModelInfo | None = None
        self.block_manager: BlockManager | None = None
        self.requests: dict[str, Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admission order
        self._in_executor: set[int] = set()  # seq ids the executor holds state for
        self._to_drop: list[int] = []
        self._pending_events: list[RequestEvent] = []
        self._step_id = 0
        self.num_preemptions = 0
        self.num_finished = 0

    # -- executor lifecycle ------------------------------------------------

    def attach_executor(self, model: ModelInfo) -> None:
        """A new executor incarnation: its KV cache is empty, so every running
        sequence goes back to the front of the queue to be recomputed."""
        self._preempt_all()
        self.model = model
        self.block_manager = BlockManager(model.num_blocks, model.block_size)
        self._in_executor.clear()
        self._to_drop.clear()

    def detach_executor(self) -> None:
        """The executor is gone: nothing can run until ``attach_executor``."""
        self._preempt_all()
        self.model = None
        self.block_manager = None
        self._in_executor.clear()
        self._to_drop.clear()

    def resync(self) -> None:
        """The executor refused a plan: drop everything it holds and recompute
        every running sequence from the authoritative token history."""
        self._preempt_all()

    def _preempt_all(self) -> None:
        for req in reversed(list(self.running)):
            self._preempt(req)

    # -- requests ------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests, "duplicate request id"
        req.arrival_time = req.arrival_time or self.clock()
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> RequestEvent | None:
        """Aborts a request; idempotent (None when unknown or already done)."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, FinishReason.ABORT)
        return RequestEvent(req, (), FinishReason.ABORT)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._to_drop)

    # -- one iteration ---------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        assert self.block_manager is not None, "schedule() without an executor"
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        done: set[int] = set()
        preempted = False
        # Decodes (one token left to compute) before partial prefills.
        order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for req in order:
            if req.status != RequestStatus.RUNNING or budget == 0:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.config.chunk_size)
            if not self._make_room(req, n, done):
                preempted = True
                continue
            scheduled.append(self._take(req, n))
            done.add(req.seq_id)
            budget -= n
        if not preempted:
            budget = self._admit(budget, scheduled)
        self._step_id += 1
        drops, self._to_drop = tuple(self._to_drop), []
        return SchedulerOutput(self._step_id, tuple(scheduled), drops)

    def _make_room(self, req: Request, n: int, done: set[int]) -> bool:
        """Preempts until ``req`` can hold ``n`` more tokens; False if ``req``
        itself had to go."""
        bm = self.block_manager
        target = req.num_computed_tokens + n
        while not bm.can_grow(req.seq_id, target):
            victims = [r for r in self.running if r.seq_id not in done and r is not req]
            if not victims:
                if len(self.running) == 1:
                    # Alone and the pool is full: the KV pool is its context limit.
                    self.running.remove(req)
                    self._finish(req, FinishReason.LENGTH)
                    self._pending_events.append(RequestEvent(req, (), FinishReason.LENGTH))
                else:
                    self._preempt(req)
                return False
            self._preempt(victims[-1])
        return True

    def _admit(self, budget: int, scheduled: list[ScheduledSeq]) -> int:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.config.chunk_size)
            reserve = self.config.watermark_blocks if self.running else 0
            if not bm.can_grow(req.seq_id, req.num_computed_tokens + n, reserve):
                break  # FCFS: the head waits for blocks; nobody overtakes it
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self.clock()
            self.running.append(req)
            scheduled.append(self._take(req, n))
            budget -= n
        return budget

    def _take(self, req: Request, n: int) -> ScheduledSeq:
        new_blocks = self.block_manager.grow(req.seq_id, req.num_computed_tokens + n)
        is_new = req.seq_id not in self._in_executor
        if is_new:
            self._in_executor.add(req.seq_id)
        req.num_computed_tokens += n
        samples = req.num_computed_tokens == len(req.token_ids)
        return ScheduledSeq(req, n, new_blocks, is_new, samples)

    # -- results ---------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: dict[int, int]) -> list[RequestEvent]:
        """Folds one step's sampled tokens in; returns what clients must hear."""
        events, self._pending_events = self._pending_events, []
        model = self.model
        for s in output.scheduled:
            req = s.request
            if req.status != RequestStatus.RUNNING or not s.samples:
                continue  # aborted or preempted while the step ran, or mid-prefill
            token = sampled.get(req.seq_id)
            if token is None:
                continue
            req.token_ids.append(token)
            reason = req.check_stop(model.eos_token_ids, model.max_model_len)
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason)
            events.append(RequestEvent(req, (token,), reason))
        return events

    def take_events(self) -> list[RequestEvent]:
        """Events produced outside ``update`` (e.g. a request finished by schedule)."""
        events, self._pending_events = self._pending_events, []
        return events

    # -- helpers ---------------------------------------------------------------

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: drop its KV; it re-prefills prompt + output later."""
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        self.num_finished += 1

    def _release(self, req: Request) -> None:
        if self.block_manager is not None:
            self.block_manager.free(req.seq_id)
        if req.seq_id in self._in_executor:
            self._in_executor.discard(req.seq_id)
            self._to_drop.append(req.seq_id)

    def stats(self) -> dict[str, int]:
        bm = self.block_manager
        return {
            "num_waiting": len(self.waiting),
            "num_running": len(self.running),
            "num_total_blocks": bm.num_blocks if bm else 0,
            "num_free_blocks": bm.num_free_blocks if bm else 0,
        }

    def assert_invariants(self, outputs: Iterable[SchedulerOutput] = ()) -> None:
        if self.block_manager is not None:
            self.block_manager.assert_invariants()
        for out in outputs:
            assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len(self.running) <= self.config.max_num_seqs
        for req in self.running:
            assert req.status == RequestStatus.RUNNING
            assert 0 <= req.num_computed_tokens <= req.num_tokens
