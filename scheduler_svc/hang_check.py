"""Waiting for a step's answer: a late step is a hang only if the executor is not working.

The step deadline is tight (scheduler_svc/step_deadline.py), and on an overloaded CPU a
healthy executor misses it too; calling that a hang would recompute every sequence for
nothing. So at the deadline the executor's process is looked at where it can be (its
Hello's pid is a live executor): stopped (state T/t) or no CPU used since the step was
sent is hung; CPU used is slow, checked again every FLOOR_S up to
StepDeadlines.limit, then hung anyway. Where it cannot be seen, the deadline decides.
"""

from __future__ import annotations

import asyncio

from protos.continuum.v1 import executor_pb2 as pb
from scheduler_svc.step_deadline import StepDeadlines

_STOPPED = ("T", "t")


def progress(pid: int) -> tuple[str, int] | None:
    """(state, CPU ticks used) of the local executor process ``pid``, or None when no
    such process can be seen."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"executor_svc" not in f.read():
                return None
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[11]) + int(fields[12])


def working(before: tuple[str, int] | None, now: tuple[str, int] | None) -> bool:
    return (before is not None and now is not None and now[0] not in _STOPPED
            and now[1] > before[1])


async def await_answer(answer: asyncio.Future, deadlines: StepDeadlines, num_tokens: int,
                       pid: int) -> tuple[pb.StepResult | None, str]:
    """The step's answer (None: lost or hung) and, when None by a deadline, why."""
    deadline, limit = deadlines.deadline(num_tokens), deadlines.limit(num_tokens)
    mark, waited = progress(pid), 0.0
    while True:
        try:  # shielded: a timeout must not cancel the answer the next wait may still get
            return await asyncio.wait_for(asyncio.shield(answer), deadline - waited), ""
        except TimeoutError:
            waited = deadline
        now = progress(pid)
        if not working(mark, now) or waited >= limit:
            state = "stopped" if now and now[0] in _STOPPED else \
                "busy" if working(mark, now) else "idle" if now else "not visible"
            return None, (f"the step ran past its {waited:.1f} s deadline "
                          f"(executor process {state})")
        mark, deadline = now, min(limit, waited + deadlines.floor_s)
