"""Poison-request isolation: who failed a step, and who runs next alone.

A request in a step the executor failed (it raised, hung or died) becomes a suspect:
it runs next in steps of its own (no other sequence in them), 2^(f-1) of them after
its f-th failure, so a fault that only a later position of it triggers is met alone
too. Only a failure of a step it ran alone can end it: its ``max_step_failures``-th
failure ends it with ERROR. A healthy request thus never fails alone because of
another, and a poisoned batch costs its culprit's K failures plus one step of its own
for each other request.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.lifecycle import Lifecycle
from scheduler_svc.core.plan import Event, StepRecord
from scheduler_svc.core.request import FinishReason, Request, RequestStatus

# A suspect's steps of its own double with each failure, up to 2^this.
_MAX_SOLO_SHIFT = 6


class Isolation:
    """The suspects, in the order they failed, and their steps of their own (``plan``).
    A suspect that ended meanwhile (aborted, finished) is dropped as it is met."""

    __slots__ = ("_suspects", "_lifecycle")

    def __init__(self, lifecycle: Lifecycle) -> None:
        # Requests in a failed step, not yet through their steps of their own.
        self._suspects: dict[Request, None] = {}
        self._lifecycle = lifecycle

    @property
    def active(self) -> bool:
        """Some suspect has not yet completed its steps of its own."""
        suspects = self._suspects
        if suspects:
            for req in [r for r in suspects if r.is_finished]:
                del suspects[req]
        return bool(suspects)

    def step_failed(self, scheduled: list[Request], why: str,
                    max_step_failures: int) -> list[Event]:
        """Every request of a failed step (``scheduled``, none finished) failed once more:
        it becomes a suspect, or, its last failure alone, ends with ERROR (``error``
        says why). Returns the ended ones' events."""
        ended = []
        for req in scheduled:
            req.num_failed_steps += 1
            if len(scheduled) > 1 or req.num_failed_steps < max_step_failures:
                req.num_solo_steps_due = 1 << min(req.num_failed_steps - 1, _MAX_SOLO_SHIFT)
                self._suspects[req] = None
                continue
            req.error = (f"the executor failed {req.num_failed_steps} times while "
                         f"computing this request, the last time alone ({why}); it was "
                         "ended so that the other requests could go on")
            ended.append(req)
        lc = self._lifecycle
        for req in ended:
            if req.status == RequestStatus.RUNNING:
                lc.remove_running(req, index=False)  # its blocks may hold no KV
                lc.finish(req, FinishReason.ERROR)
            else:
                lc.end_waiting(req, FinishReason.ERROR)
        return [Event(req, None, FinishReason.ERROR) for req in ended]

    def row_failed(self, req: Request, why: str, invalid_input: bool) -> Event:
        """``req``'s own per-row work (its grammar, sampling row, logprobs) failed in a step
        that stood for every other sequence: it ends alone, at once, with ERROR (its KV is
        valid: the forward pass ran), and nothing else is touched: no resync, no suspect."""
        req.error = why
        req.invalid_input = invalid_input
        self._lifecycle.end_running(req, FinishReason.ERROR)
        return Event(req, None, FinishReason.ERROR)

    def next(self) -> Request | None:
        """The suspect whose steps of its own have begun, else the first waiting one."""
        first = None
        for req in self._suspects:
            if req.status == RequestStatus.RUNNING:
                return req
            if first is None and not req.is_finished:
                first = req
        return first

    def plan(self, rec: StepRecord, req: Request, step: int, cap: int,
             config: SchedulerConfig, num_running: int,
             make_room: Callable[[Request, int], bool]) -> bool:
        """Plans step ``step`` (``rec``) as suspect ``req``'s own (the running ones wait a
        step); False when it cannot start yet (the pool or max_num_seqs is full: then
        steps without admissions free room for it)."""
        lc = self._lifecycle
        budget = config.max_num_batched_tokens
        if req.status == RequestStatus.RUNNING:
            return self._plan_running(rec, req, step, min(budget, cap), make_room)
        if num_running >= config.max_num_seqs:
            return False
        bm = lc.block_manager
        if bm.blocks_needed(len(req.token_ids)) > bm.num_blocks:
            lc.end_waiting(req, FinishReason.LENGTH)  # it can never resume in full
            rec.end(req, FinishReason.LENGTH)
            return False
        if req.status == RequestStatus.SWAPPED:
            n, _ = lc.swap_in(req, rec, budget, cap, 0, step)
        else:
            n, _ = lc.start(req, rec, budget, cap, 0, step)
        if n:
            rec.isolated = req
            rec.num_batched_tokens = n
        return n > 0

    def _plan_running(self, rec: StepRecord, req: Request, step: int, most: int,
                      make_room: Callable[[Request, int], bool]) -> bool:
        """The next step of a running suspect (not in the bulk: it runs no batched step
        while it has steps of its own due, so it never joins)."""
        n = min(len(req.token_ids) - req.num_computed_tokens, most)
        if n <= 0:  # no sample came for it: nothing to run alone, let it batch
            self.discard(req)
            return False
        if not make_room(req, req.num_computed_tokens + n):
            return False  # preempted itself (or ended): it starts alone again later
        rec.add_chunk(req, n, self._lifecycle.advance(req, n, step))  # samples iff complete
        rec.num_batched_tokens = n
        if n > 1 or req.num_computed_tokens < len(req.token_ids):
            rec.num_prefill_tokens += n
        rec.isolated = req
        return True

    def solo_step_done(self, req: Request) -> None:
        req.num_solo_steps_due -= 1
        if req.num_solo_steps_due <= 0:
            self._suspects.pop(req, None)

    def discard(self, req: Request) -> None:
        """``req`` ended, or has nothing to run alone."""
        self._suspects.pop(req, None)
