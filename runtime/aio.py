"""Stopping asyncio tasks for sure (the scheduler's loop and link, the gateway's pollers,
watchdog and relays).

Python 3.11's ``asyncio.wait_for`` returns its result instead of raising when the task is
cancelled in the very iteration the awaited future completes: the cancellation is lost and
a loop task goes on to wait for work that never comes (a shutdown that hangs). So a stop
cancels again, as many times as it takes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

RECANCEL_S = 0.5


async def cancel_all(tasks: Iterable[asyncio.Task]) -> None:
    """Cancels ``tasks`` and returns once every one of them has ended (their exceptions
    retrieved, as ``gather(..., return_exceptions=True)`` would)."""
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for task in tasks:
        if not task.cancelled():
            task.exception()
