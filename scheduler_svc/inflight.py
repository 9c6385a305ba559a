"""Plans sent to the executor and not yet answered, oldest first.

With async scheduling there are two (step N+1 waits in the executor's socket while N
runs); the executor answers in order, and an answer matches the oldest plan's step id.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time

from protos.continuum.v1 import executor_pb2 as pb
from scheduler_svc.core import SchedulerOutput


@dataclasses.dataclass
class InFlight:
    out: SchedulerOutput
    answer: asyncio.Future[pb.StepResult | None]
    sent_at: float  # time.monotonic()
    sent: bool = True  # False: the send failed, the executor never saw it
    # The answer's seq ids (packed bytes or a list) and tokens (protos/wire.py
    # result_columns), read once when it was checked; set with the answer.
    columns: tuple[bytes | list[int], list[int]] = ([], [])


class InFlightPlans:
    """At most ``depth`` unanswered plans. An answer that matches none (a plan made void
    by a resync, or another incarnation's) is ignored."""

    def __init__(self) -> None:
        self._plans: collections.deque[InFlight] = collections.deque()

    def __len__(self) -> int:
        return len(self._plans)

    def add(self, out: SchedulerOutput) -> InFlight:
        item = InFlight(out, asyncio.get_running_loop().create_future(), time.monotonic())
        self._plans.append(item)
        return item

    def oldest(self) -> InFlight:
        return self._plans[0]

    def pop_oldest(self) -> InFlight:
        return self._plans.popleft()

    def answer(self, result: pb.StepResult,
               columns: tuple[bytes | list[int], list[int]]) -> None:
        for item in self._plans:
            if item.out.step_id == result.step_id:
                if not item.answer.done():
                    item.columns = columns
                    item.answer.set_result(result)
                return

    def fail_all(self) -> bool:
        """No answer will come (the executor is gone): every waiter wakes with None.
        True if any plan was in flight."""
        for item in self._plans:
            if not item.answer.done():
                item.answer.set_result(None)
        return bool(self._plans)

    def void_all(self) -> None:
        """Forgets every plan: answers to them will be ignored."""
        for item in self._plans:
            item.answer.cancel()
        self._plans.clear()
