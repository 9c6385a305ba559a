"""What the loop does with a step that did not stand, or a row that failed in one.

A step the executor failed (it raised, missed its deadline, or was lost while running
it) is blamed on the requests in it (Scheduler.step_failed: one that keeps failing is
ended alone with ERROR, the rest recompute). A plan refused for another reason is the
scheduler's own mistake: every running sequence is resynchronized, and the plan's
requests are blamed only after MAX_CONSECUTIVE_REFUSALS in a row, so a plan the
scheduler keeps getting wrong for them cannot resynchronize forever. A row that failed
inside a step that stood (StepResult.row_failures) ends its request alone.

The counters here are the replica's (Stats, /metrics).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from protos.continuum.v1 import executor_pb2 as pb
from scheduler_svc.core import Event, Scheduler, SchedulerOutput

log = structlog.get_logger("scheduler.loop")

MAX_CONSECUTIVE_REFUSALS = 3


class StepFaults:
    """Blame and resynchronization for one loop's core; ``dispatch`` delivers the events
    of the requests that end."""

    def __init__(self, core: Scheduler, dispatch: Callable[[list[Event]], None]) -> None:
        self._core = core
        self._dispatch = dispatch
        self._consecutive_refusals = 0
        self.num_failed_steps = 0
        self.num_resyncs = 0  # refused or failed plans: every running sequence recomputed
        self.num_row_failures = 0  # requests ended alone by StepResult.row_failures
        self.num_executor_dropped_sequences = 0  # as the executor counted them

    def stood(self) -> None:
        """A step was answered with samples: the refusals in a row start again."""
        self._consecutive_refusals = 0

    def rows_failed(self, result: pb.StepResult) -> None:
        """Sequences whose own row failed in a step that stood: each request ends alone;
        every other sequence's sample applies as usual."""
        events = []
        for failure in result.row_failures:
            ev = self._core.row_failed(
                failure.seq_id, f"the request failed while sampling its next token "
                f"({failure.stage}): {failure.message}", failure.invalid_input)
            if ev is not None:
                self.num_row_failures += 1
                log.warning("request ended: its own row failed", request_id=ev[0].request_id,
                            stage=failure.stage, why=failure.message)
                events.append(ev)
        self._dispatch(events)

    def refused(self, out: SchedulerOutput, result: pb.StepResult) -> None:
        """A failed forward blames the plan's requests at once; other refusals only after
        MAX_CONSECUTIVE_REFUSALS in a row. Then the core resynchronizes; the caller voids
        the plans in flight, built on what the executor refused."""
        log.error("executor refused plan; resynchronizing", code=result.error_code,
                  message=result.error_message)
        self.num_resyncs += 1
        self.num_executor_dropped_sequences += result.num_dropped_sequences
        self._consecutive_refusals += 1
        if result.error_code == pb.STEP_ERROR_CODE_INTERNAL or \
                self._consecutive_refusals >= MAX_CONSECUTIVE_REFUSALS:
            self._consecutive_refusals = 0
            self.failed(out, result.error_message or "the step failed")
        self._core.resync()

    def failed(self, out: SchedulerOutput, why: str) -> None:
        """The executor ran ``out`` and it failed as a whole: its requests are blamed."""
        self.num_failed_steps += 1
        events = self._core.step_failed(out, why)
        for req, _, _, _ in events:
            log.error("request ended: it failed too many steps", request_id=req.request_id,
                      why=why)
        self._dispatch(events)
