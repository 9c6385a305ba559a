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

from scheduler_svc.core.request import Request, RequestStatus

# A suspect's steps of its own double with each failure, up to 2^this.
_MAX_SOLO_SHIFT = 6


class Isolation:
    """The suspects, in the order they failed; the scheduler plans their solo steps."""

    __slots__ = ("suspects",)

    def __init__(self) -> None:
        # Requests in a failed step, not yet through their steps of their own.
        self.suspects: dict[Request, None] = {}

    def step_failed(self, scheduled: list[Request], why: str,
                    max_step_failures: int) -> list[Request]:
        """Every request of a failed step (``scheduled``, none finished) failed once more.
        Returns those that must end now (their ``error`` says why); the rest are
        suspects."""
        ended = []
        for req in scheduled:
            req.num_failed_steps += 1
            if len(scheduled) > 1 or req.num_failed_steps < max_step_failures:
                req.num_solo_steps_due = 1 << min(req.num_failed_steps - 1, _MAX_SOLO_SHIFT)
                self.suspects[req] = None
                continue
            req.error = (f"the executor failed {req.num_failed_steps} times while "
                         f"computing this request, the last time alone ({why}); it was "
                         "ended so that the other requests could go on")
            ended.append(req)
        return ended

    def next(self) -> Request | None:
        """The suspect whose steps of its own have begun, else the first waiting one."""
        first = None
        for req in self.suspects:
            if req.status == RequestStatus.RUNNING:
                return req
            first = first or req
        return first

    def solo_step_done(self, req: Request) -> None:
        req.num_solo_steps_due -= 1
        if req.num_solo_steps_due <= 0:
            self.suspects.pop(req, None)

    def discard(self, req: Request) -> None:
        """``req`` ended, or has nothing to run alone."""
        self.suspects.pop(req, None)
