"""Warm standby executors against the real engine loop and link on an ipc socket, with
fake executors (tests/scheduler/fake_peer.py): a standby is kept aside, takes over when
the executor disconnects or hangs (the hang called by the measured-step deadline, not
the cold floor), and every failure around it (the standby dying first, dying while it
takes over, going silent) degrades to waiting for a new executor, never to a wedge or a
lost or duplicated token."""

from __future__ import annotations

import asyncio
import time

from scheduler_svc.core import FinishReason, SchedulerConfig
from scheduler_svc.loop import EngineLoop
from scheduler_svc.step_deadline import COLD_FLOOR_S
from tests.scheduler.factories import make_request
from tests.scheduler.fake_peer import SECRET, FakePeer, make_hello
from tests.scheduler.test_engine_faults import drain, until


def _engine(tmp_path, **config) -> tuple[EngineLoop, str]:
    address = f"ipc://{tmp_path}/s.sock"
    return EngineLoop(SchedulerConfig(watermark=0.0, **config), address,
                      secret=SECRET), address


def _submit(loop: EngineLoop, n: int = 3, max_tokens: int = 30) -> dict:
    return {f"r{i}": loop.submit(make_request(prompt_len=5 + i, max_tokens=max_tokens,
                                              request_id=f"r{i}")) for i in range(n)}


async def _finish(queues: dict) -> None:
    """Every request ends with LENGTH and exactly the fake's tokens (100 + seq id +
    position): none lost, none duplicated, whichever executor computed them."""
    for queue in queues.values():
        events = await drain(queue)
        req = events[0][0]
        assert events[-1][2] == FinishReason.LENGTH
        streamed = [t for _, t, _, _ in events if t is not None]
        assert streamed == [100 + req.seq_id + p
                            for p in range(req.num_prompt_tokens, req.num_tokens)]


async def _serve_then(peer: FakePeer, plans: int, then: str) -> None:
    """Answers ``plans`` plans, then closes (``"die"``) or goes silent (``"hang"``)."""
    for _ in range(plans):
        plan = await peer.next_plan()
        await peer.send("result", peer.answer(plan))
    if then == "die":
        peer.close()
    else:
        await asyncio.sleep(3600)


class _Replica:
    """A started engine loop with an executor (pid 11) and a standby (pid 22)
    registered; ``peer`` makes more fake executors. Every peer (a ZeroMQ context each)
    and the loop are closed on exit however the test ended: a context left to the
    garbage collector can block in term() in a later test."""

    def __init__(self, tmp_path, **config) -> None:
        self.loop, self.address = _engine(tmp_path, **config)
        self.peers: list[FakePeer] = []

    def peer(self, identity: bytes) -> FakePeer:
        self.peers.append(FakePeer(self.address, identity))
        return self.peers[-1]

    async def __aenter__(self) -> _Replica:
        self.loop.start()
        try:
            self.active, self.standby = self.peer(b"active"), self.peer(b"standby")
            await self.active.say_hello(make_hello(pid=11))
            await until(lambda: self.loop.executor is not None)
            await self.standby.say_hello(make_hello(pid=22, standby=True))
            await until(lambda: self.loop.link.standby == b"standby")
        except BaseException:
            await self.__aexit__()
            raise
        assert self.loop.executor.pid == 11 and self.loop.link.peer == b"active"
        return self

    async def __aexit__(self, *exc) -> None:
        for peer in self.peers:
            peer.close()
        await self.loop.stop()


def test_the_standby_takes_over_when_the_executor_disconnects(tmp_path):
    async def go():
        async with _Replica(tmp_path) as r:
            queues = _submit(r.loop)
            tasks = [asyncio.create_task(_serve_then(r.active, 6, "die")),
                     asyncio.create_task(r.standby.serve(timeout=30))]
            await _finish(queues)
            assert r.loop.num_standby_takeovers == 1 and r.loop.executor.pid == 22
            assert r.loop.link.standby is None and not r.loop.fatal.done()
            for task in tasks:
                task.cancel()

    asyncio.run(go())


def test_a_hung_executor_is_called_by_the_measured_deadline_and_replaced(tmp_path):
    async def go():
        async with _Replica(tmp_path) as r:
            loop = r.loop
            queues = _submit(loop)
            hang = asyncio.create_task(_serve_then(r.active, 12, "hang"))
            await until(lambda: hang.done() or loop.steps.num_steps >= 12)
            assert loop.deadlines.warm  # 12 fast steps: the floor applies, not the cold one
            stalled_at = time.monotonic()
            served = asyncio.create_task(r.standby.next_plan(timeout=60))
            first = await served
            # Called well before the cold floor (the old fixed 5 s); generous for a busy box.
            assert time.monotonic() - stalled_at < COLD_FLOOR_S - 1
            await r.standby.send("result", r.standby.answer(first))
            server = asyncio.create_task(r.standby.serve(timeout=30))
            await _finish(queues)
            assert loop.num_standby_takeovers == 1 and loop.last_lost_executor_pid == 11
            hang.cancel()
            server.cancel()

    asyncio.run(go())


def test_losing_the_standby_first_or_during_its_takeover_waits_for_a_new_executor(tmp_path):
    """The standby dies before the executor, then the replacement dies on its first
    plan: each time the loop has nobody, waits, and a fresh executor finishes the work.
    Whether the first executor's last plan left before it closed is a race; when it did,
    its requests are suspects and the second executor dies in one's step of its own,
    which the default max_step_failures (2) would end as a poison request
    (tests/integration/test_poison.py). Here the deaths are the executors', so allow 3."""
    async def go():
        async with _Replica(tmp_path, max_step_failures=3) as r:
            loop = r.loop
            r.standby.close()
            await until(lambda: loop.link.standby is None)  # forgotten on disconnect
            queues = _submit(loop)
            await _serve_then(r.active, 4, "die")
            await until(lambda: loop.executor is None)
            second = r.peer(b"second")
            await second.say_hello(make_hello(pid=33, standby=True))  # nobody: in service
            await until(lambda: loop.executor is not None and loop.executor.pid == 33)
            third = r.peer(b"third")
            await third.say_hello(make_hello(pid=44, standby=True))
            await until(lambda: loop.link.standby == b"third")
            await second.next_plan()
            second.close()  # dies while taking over: the third takes over in turn
            server = asyncio.create_task(third.serve(timeout=30))
            await _finish(queues)
            assert loop.executor.pid == 44 and loop.num_standby_takeovers == 1
            server.cancel()

    asyncio.run(go())


def test_a_silent_standby_is_dropped_and_named_for_its_supervisor(tmp_path):
    async def go():
        replica = _Replica(tmp_path)
        replica.loop.heartbeat_timeout_s = 1.5  # probes go every HEARTBEAT_S (1 s)
        async with replica as r:
            server = asyncio.create_task(r.active.serve(timeout=30))  # answers heartbeats
            await until(lambda: r.loop.link.standby is None)  # the standby never answers
            assert r.loop.last_lost_executor_pid == 22 and r.loop.executor.pid == 11
            assert r.loop.num_executor_losses == 0
            server.cancel()

    asyncio.run(go())


def test_both_dying_at_once_ends_no_request(tmp_path):
    """The standby and the executor die together: a plan sent to the standby the link had
    not yet seen go is not blamed on its requests (they were blamed once already, for
    the executor's step), so a fresh executor finishes every one without an error."""
    async def go():
        async with _Replica(tmp_path) as r:
            fresh = r.peer(b"fresh")
            queues = _submit(r.loop)
            await _serve_then(r.active, 4, "die")  # the standby goes in the same instant
            r.standby.close()
            await until(lambda: r.loop.executor is None and r.loop.link.standby is None)
            await fresh.say_hello(make_hello(pid=55))
            server = asyncio.create_task(fresh.serve(timeout=30))
            await _finish(queues)
            server.cancel()

    asyncio.run(go())
