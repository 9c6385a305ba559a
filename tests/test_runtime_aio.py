"""runtime/aio.cancel_all stops a task even when a cancellation is lost, as Python 3.11's
``asyncio.wait_for`` loses one when its future completes in the same iteration."""

from __future__ import annotations

import asyncio

from runtime.aio import cancel_all


def test_a_task_that_swallows_a_cancellation_is_still_stopped():
    async def go():
        swallowed = 0

        async def stubborn():
            nonlocal swallowed
            while True:
                try:
                    await asyncio.Event().wait()  # what a loop does between work
                except asyncio.CancelledError:
                    if swallowed:
                        raise
                    swallowed += 1  # the lost cancellation: it goes on waiting

        async def failing():
            raise RuntimeError("a task that died before the stop")

        tasks = [asyncio.create_task(stubborn()), asyncio.create_task(failing())]
        await asyncio.sleep(0)
        await asyncio.wait_for(cancel_all(tasks), 5)
        assert swallowed == 1 and all(t.done() for t in tasks)
        # A plain cancel-then-gather would wait forever on the stubborn task.
        again = asyncio.create_task(stubborn())
        await asyncio.sleep(0)
        swallowed = 0
        again.cancel()
        done, _ = await asyncio.wait([again], timeout=0.3)
        assert not done
        await cancel_all([again])

    asyncio.run(go())
