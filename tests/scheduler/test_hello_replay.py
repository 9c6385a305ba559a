"""A recorded Hello cannot take the executor's place: each signed Hello is believed once
and only while fresh (scheduler_svc/link.py ``_replay_problem``), on a real ipc socket."""

from __future__ import annotations

import asyncio
import time

from scheduler_svc.link import HELLO_MAX_SKEW_S
from tests.scheduler.fake_peer import linked_peers, make_hello
from tests.scheduler.test_engine_faults import until


def test_a_replayed_or_stale_hello_is_refused_and_a_fresh_one_is_believed(tmp_path):
    async def go():
        async with linked_peers(f"ipc://{tmp_path}/s.sock", b"executor", b"thief") as (
                link, hellos, (executor, thief)):
            recorded = make_hello()
            await executor.say_hello(recorded)
            await until(lambda: hellos)
            assert link.peer == b"executor"
            await thief.say_hello(recorded)  # the same signed bytes, from elsewhere
            stale = make_hello(sent_at=time.time() - 2 * HELLO_MAX_SKEW_S)
            future = make_hello(sent_at=time.time() + 2 * HELLO_MAX_SKEW_S)
            await thief.say_hello(stale)
            await thief.say_hello(future)
            await until(lambda: link.num_dropped_frames == 3)
            assert link.peer == b"executor" and len(hellos) == 1
            fresh = make_hello(incarnation=recorded.incarnation)  # re-signed: believed
            await executor.say_hello(fresh)
            await until(lambda: len(hellos) == 2)
            assert link.peer == b"executor"

    asyncio.run(go())
